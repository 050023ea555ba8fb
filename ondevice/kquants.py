"""ggml's K-quant blocks (Q4_K, Q5_K, Q6_K): unpacking, embedding-row dequantisation, and the planes layout.

File blocks (256 weights per super-block):
  Q4_K (144 B): f16 d, f16 dmin, 12 B of 6-bit scales/mins for 8 sub-blocks of 32, 128 B of nibbles;
                w = d*sc_j*q - dmin*m_j, q in 0..15. Byte 32p+l holds element 64p+l (low nibble, sub-block 2p)
                and element 64p+32+l (high nibble, sub-block 2p+1).
  Q5_K (176 B): as Q4_K plus qh[32]: bit 2p of qh[l] is bit 4 of element 64p+l, bit 2p+1 that of 64p+32+l.
  Q6_K (210 B): ql[128], qh[64], int8 scales[16] (sub-blocks of 16), f16 d last; w = d*sc_j*(q-32), q in 0..63.

Planes (what ``matvec.py`` computes on), per group of 64 output rows (four sub-groups s of 16 rows): 64
consecutive bytes hold 4 consecutive quants of 16 rows (one AVX-512 load), in the order the kernels read them
(sequential streams), and the scales per sub-group as 16-lane vectors:
  Q4_K: quants [s][super-block][pair p 4][quad c 8][r 16][4] nibble bytes as in the file (2048 B per s and
        super-block: a sub-group's rows are one contiguous stream); scales [s][super-block][d f16 x16, dmin f16
        x16, sc u8 [8][16], m u8 [8][16]] (320 B).
  Q5_K: quants as full bytes 0..31, [s][super-block][chunk 8][k 8][r 16][4] (4096 B per s and super-block: a
        sub-group's rows are one contiguous stream); scales [s][super-block][d, dmin, sc, m as Q4_K] (320 B).
  Q6_K: quants as full bytes 0..63, same order; scales [s][super-block][d f16 x16, sc i8 [16][16]] (288 B).
Rows are padded to a multiple of 64 with zero blocks (their outputs are never read).
"""
from __future__ import annotations

import numpy as np

QK_K = 256
R = 64
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
QUANT_BYTES = {"Q4_K": 8192, "Q5_K": 16384, "Q6_K": 16384}  # per group of 64 rows per super-block
SCALE_BYTES = {"Q4_K": 1280, "Q5_K": 1280, "Q6_K": 1152}


def _f16(raw_u8) -> np.ndarray:
  return np.ascontiguousarray(raw_u8).view(np.float16)[..., 0].astype(np.float32)


def _scales_mins_k4(s_NxBx12: np.ndarray) -> tuple:
  """ggml's get_scale_min_k4 for all 8 sub-blocks: (sc, m) uint8 (N, B, 8), 6 bits each."""
  s = s_NxBx12.astype(np.uint8)
  sc = np.empty(s.shape[:-1] + (8,), np.uint8)
  m = np.empty_like(sc)
  sc[..., :4] = s[..., 0:4] & 63
  m[..., :4] = s[..., 4:8] & 63
  sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
  m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
  return sc, m


def unpack(qtype: str, raw_OxR: np.ndarray, n_in: int) -> dict:
  """File rows -> {'q': uint8 (O, n_in) unsigned quants, 'd', 'dmin': f32 (O, nb), 'sc', 'm': (O, nb, 8 or 16)}."""
  nb = n_in // QK_K
  blk = np.asarray(raw_OxR, np.uint8).reshape(-1, nb, BLOCK_BYTES[qtype])
  O = blk.shape[0]
  if qtype in ("Q4_K", "Q5_K"):
    d, dmin = _f16(blk[..., 0:2]), _f16(blk[..., 2:4])
    sc, m = _scales_mins_k4(blk[..., 4:16])
    qs = blk[..., -128:].reshape(O, nb, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=3)  # (O, nb, pair, lo/hi, 32)
    if qtype == "Q5_K":
      qh = blk[..., 16:48]  # (O, nb, 32)
      bits = np.stack([(qh >> (2 * p + h)) & 1 for p in range(4) for h in range(2)], axis=2).reshape(O, nb, 4, 2, 32)
      q = q | (bits << 4)
    return {"q": q.reshape(O, n_in), "d": d, "dmin": dmin, "sc": sc, "m": m}
  if qtype == "Q6_K":
    ql, qh, sc = blk[..., 0:128], blk[..., 128:192], blk[..., 192:208].view(np.int8)
    d = _f16(blk[..., 208:210])
    ql = ql.reshape(O, nb, 2, 64)
    qh = qh.reshape(O, nb, 2, 32)
    parts = [(ql[..., :32] & 15) | ((qh & 3) << 4), (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
             (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4), (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)]
    q = np.stack(parts, axis=3)  # (O, nb, half, part, 32)
    return {"q": q.reshape(O, n_in), "d": d, "sc": sc.astype(np.int32)}
  raise ValueError(f"{qtype} is not a K-quant")


def dequantize_rows(qtype: str, raw_OxR: np.ndarray, n_in: int) -> np.ndarray:
  """Rows as ggml's get_rows computes them (dequantize_row_* in ggml-base, float32, no fused multiply-add):
  Q4_K/Q5_K: fl(fl(d*sc)*q) - fl(dmin*m); Q6_K: fl(fl(d*sc)*(q-32))."""
  u = unpack(qtype, raw_OxR, n_in)
  O, nb = u["d"].shape
  if qtype == "Q6_K":
    d1 = (u["d"][..., None] * u["sc"].astype(np.float32)).astype(np.float32)  # (O, nb, 16)
    q = u["q"].reshape(O, nb, 16, 16).astype(np.float32) - np.float32(32)
    return (d1[..., None] * q).astype(np.float32).reshape(O, n_in)
  d1 = (u["d"][..., None] * u["sc"].astype(np.float32)).astype(np.float32)
  m1 = (u["dmin"][..., None] * u["m"].astype(np.float32)).astype(np.float32)
  q = u["q"].reshape(O, nb, 8, 32).astype(np.float32)
  return ((d1[..., None] * q).astype(np.float32) - m1[..., None]).astype(np.float32).reshape(O, n_in)


def _pad(a: np.ndarray) -> np.ndarray:
  n = -(-a.shape[0] // R) * R
  if n == a.shape[0]:
    return a
  return np.concatenate([a, np.zeros((n - a.shape[0],) + a.shape[1:], a.dtype)])


def _vec16(a_OxNB: np.ndarray, dtype) -> np.ndarray:
  """(O, nb[, k]) per-row values -> bytes (G, nb, 4 sub-groups, [k,] 16 rows) as a flat byte array per (g, b, s)."""
  a = _pad(np.asarray(a_OxNB, dtype))
  G = a.shape[0] // R
  a = a.reshape((G, 4, 16) + a.shape[1:])  # (G, s, r, nb[, k])
  a = np.moveaxis(a, 3, 1)  # (G, nb, s, r[, k])
  if a.ndim == 5:
    a = np.swapaxes(a, 3, 4)  # (G, nb, s, k, r)
  return np.ascontiguousarray(a).view(np.uint8).reshape(G, a.shape[1], 4, -1)


def repack(qtype: str, raw_OxR: np.ndarray, n_in: int) -> tuple:
  """File rows -> (quant planes uint8 (G, nb * QUANT_BYTES), scale planes uint8 (G, nb * SCALE_BYTES))."""
  if n_in % QK_K:
    raise ValueError(f"{qtype} rows need a multiple of {QK_K} inputs, got {n_in}")
  nb = n_in // QK_K
  u = unpack(qtype, raw_OxR, n_in)
  if qtype == "Q4_K":
    qs = _pad(np.asarray(raw_OxR, np.uint8).reshape(-1, nb, BLOCK_BYTES[qtype])[..., -128:])
    G = qs.shape[0] // R
    q = qs.reshape(G, 4, 16, nb, 4, 8, 4).transpose(0, 1, 3, 4, 5, 2, 6)  # (G, s, nb, p, c, r, i)
  else:
    qv = _pad(u["q"]).reshape(-1, nb, QK_K)
    G = qv.shape[0] // R
    q = qv.reshape(G, 4, 16, nb, 8, 8, 4).transpose(0, 1, 3, 4, 5, 2, 6)  # (G, s, nb, chunk, k, r, i)
  d = _vec16(u["d"].astype(np.float16), np.float16)
  if qtype == "Q6_K":
    s = np.concatenate([d, _vec16(u["sc"].astype(np.int8), np.int8)], axis=-1)
  else:
    s = np.concatenate([d, _vec16(u["dmin"].astype(np.float16), np.float16), _vec16(u["sc"], np.uint8),
                        _vec16(u["m"], np.uint8)], axis=-1)
  s = s.transpose(0, 2, 1, 3)  # (G, s, nb, bytes): a sub-group's scales follow its quants' order
  return (np.ascontiguousarray(q).reshape(G, -1), np.ascontiguousarray(s).reshape(G, -1))
