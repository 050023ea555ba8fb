"""More LLVM-level kernels for ``matvec.py`` (numba ``@intrinsic``s): the BF16 dot with the AVX-512 BF16 instruction.

``vdot_bf16``: a row of bf16 weights (uint16 bits) times activations rounded to bf16 (kept as float32 values),
with ``vdpbf16ps`` (inline assembly: llvmlite has no bfloat type) as llama.cpp's AVX512-BF16 build does:
one token: ggml_vec_dot_bf16 (two accumulators, 64 inputs per step, each reduced by _mm512_reduce_add_ps and
summed in double, leftovers in double); a batch: tinyBLAS (one accumulator over 32 inputs per step, reduced).
The instruction's own rounding (it adds its two products to the accumulator one after the other, flushing
denormals) is what both engines get, so the results are bit-identical where the CPU has it (``has_bf16``).
"""
from __future__ import annotations

from ondevice.simd import HAVE_NUMBA

if HAVE_NUMBA:
  from llvmlite import binding, ir
  from numba import types as nbt
  from numba.core import cgutils
  from numba.extending import intrinsic

  from ondevice.simd import F32, I32, I64, _ptr, _reduce16, _vec

  binding.initialize_native_asmparser()  # numba does not: inline assembly (vdpbf16ps) needs it


def has_bf16() -> bool:
  return HAVE_NUMBA and "+avx512bf16" in binding.get_host_cpu_features().flatten().split(",")


if HAVE_NUMBA:
  def _dp(builder, acc, a_v16i, b_v16i):
    fn = ir.InlineAsm(ir.FunctionType(acc.type, [acc.type, a_v16i.type, b_v16i.type]), "vdpbf16ps $3, $2, $0",
                      "=v,0,v,v")
    return builder.call(fn, [acc, a_v16i, b_v16i])

  def _pairs(builder, context, aryty, ary, off):
    """32 float32 values (bf16-exact) at ary[off:] -> their bf16 bits packed two per i32 lane (low = even)."""
    v = builder.bitcast(builder.load(_ptr(context, builder, aryty, ary, off, _vec(F32, 32)), align=4), _vec(I32, 32))
    hi = builder.lshr(v, ir.Constant(_vec(I32, 32), [16] * 32))
    ev = builder.shuffle_vector(hi, hi, ir.Constant(_vec(I32, 16), list(range(0, 32, 2))))
    od = builder.shuffle_vector(v, v, ir.Constant(_vec(I32, 16), list(range(1, 32, 2))))
    od = builder.and_(od, ir.Constant(_vec(I32, 16), [-65536] * 16))
    return builder.or_(ev, od)

  @intrinsic
  def vdot_bf16(typingctx, x, xo, w, wo, n, tiny):
    """sum_i x[xo+i] * bf16(w[wo+i]) for i < n in ggml's order (module docstring); tiny: tinyBLAS (n % 32 == 0)."""
    def codegen(context, builder, sig, args):
      xa, xo_, wa, wo_, n_, tiny_ = args
      v16f, d = _vec(F32, 16), ir.DoubleType()
      zero = ir.Constant(v16f, [0.0] * 16)
      c1, c2 = cgutils.alloca_once_value(builder, zero), cgutils.alloca_once_value(builder, zero)
      res = cgutils.alloca_once_value(builder, ir.Constant(d, 0.0))

      def wv(off):
        return builder.load(_ptr(context, builder, sig.args[2], wa, builder.add(wo_, off), _vec(I32, 16)), align=2)

      with builder.if_else(tiny_) as (then, other):
        with then:
          n32 = builder.and_(n_, ir.Constant(I64, ~31))
          with cgutils.for_range_slice(builder, ir.Constant(I64, 0), n32, ir.Constant(I64, 32), inc=True) as (i, _):
            builder.store(_dp(builder, builder.load(c1), wv(i), _pairs(builder, context, sig.args[0], xa,
                                                                         builder.add(xo_, i))), c1)
          builder.store(builder.fpext(_reduce16(builder, builder.load(c1)), d), res)
        with other:
          n64 = builder.and_(n_, ir.Constant(I64, ~63))
          with cgutils.for_range_slice(builder, ir.Constant(I64, 0), n64, ir.Constant(I64, 64), inc=True) as (i, _):
            i2 = builder.add(i, ir.Constant(I64, 32))
            builder.store(_dp(builder, builder.load(c1), wv(i), _pairs(builder, context, sig.args[0], xa,
                                                                         builder.add(xo_, i))), c1)
            builder.store(_dp(builder, builder.load(c2), wv(i2), _pairs(builder, context, sig.args[0], xa,
                                                                          builder.add(xo_, i2))), c2)
          s = builder.fadd(ir.Constant(d, 0.0), builder.fpext(_reduce16(builder, builder.load(c1)), d))
          s = builder.fadd(s, builder.fpext(_reduce16(builder, builder.load(c2)), d))
          builder.store(s, res)
          with cgutils.for_range_slice(builder, n64, n_, ir.Constant(I64, 1), inc=True) as (i, _):
            xv = builder.load(_ptr(context, builder, sig.args[0], xa, builder.add(xo_, i), F32))
            wb = builder.load(_ptr(context, builder, sig.args[2], wa, builder.add(wo_, i), ir.IntType(16)))
            wf = builder.bitcast(builder.shl(builder.zext(wb, I32), ir.Constant(I32, 16)), F32)
            builder.store(builder.fadd(builder.load(res), builder.fpext(builder.fmul(xv, wf), d)), res)
      return builder.fptrunc(builder.load(res), F32)
    return nbt.float32(x, nbt.int64, w, nbt.int64, nbt.int64, nbt.boolean), codegen


# ------------------------------------------------------------------------------------------ K-quant rows

if HAVE_NUMBA:
  from ondevice.simd import _dpbusd, _fma, _splat, has_vnni

  def _ld(context, builder, aryty, ary, off, vt, align=1):
    return builder.load(_ptr(context, builder, aryty, ary, off, vt), align=align)

  def _i32x16(builder, v16_i8, signed):
    return (builder.sext if signed else builder.zext)(v16_i8, _vec(I32, 16))

  def _hsum8(builder, a):
    t = [builder.fadd(a[4 + i], a[i]) for i in range(4)]
    return builder.fadd(builder.fadd(t[0], t[2]), builder.fadd(t[1], t[3]))

  def _q4k(context, builder, sig, args, pairs: bool):
    """matvec.q4k_rows as vector code, one sub-group of 16 rows (a contiguous stream) at a time: VNNI integer
    sub-block dots, the float order of ggml's repacked gemv (per super-block) or gemm (per pair of sub-blocks)."""
    W, qo, S, so, nb, x32, xo, kd, kbs, out, oo = args
    t = sig.args
    vnni = has_vnni()
    v16i, v16f, v64b, v16b, v16h = _vec(I32, 16), _vec(F32, 16), _vec(ir.IntType(8), 64), _vec(ir.IntType(8), 16), \
        _vec(ir.HalfType(), 16)
    zi, zf = ir.Constant(v16i, [0] * 16), ir.Constant(v16f, [0.0] * 16)
    c = lambda v: ir.Constant(I64, v)  # noqa: E731
    for s in range(4):
      A, M = cgutils.alloca_once_value(builder, zf), cgutils.alloca_once_value(builder, zf)
      with cgutils.for_range(builder, nb) as loop:
        b = loop.index
        sbk = builder.add(builder.mul(nb, c(s)), b)
        qb = builder.add(qo, builder.mul(sbk, c(2048)))
        ss = builder.add(so, builder.mul(sbk, c(320)))
        dx = _splat(builder, builder.load(_ptr(context, builder, t[7], kd, b, F32)), 16)
        xb = builder.add(xo, builder.mul(b, c(64)))
        bsb = builder.mul(b, c(16))
        bs = [builder.load(_ptr(context, builder, t[8], kbs, builder.add(bsb, c(j)), I32)) for j in range(16)]
        dwx = builder.fmul(builder.fpext(_ld(context, builder, t[2], S, ss, v16h), v16f), dx)
        dmx = builder.fmul(builder.fpext(_ld(context, builder, t[2], S, builder.add(ss, c(32)), v16h), v16f), dx)
        tot, totm = zi, zi
        for p in range(4):
          lo, hi = [zi, zi], [zi, zi]  # two chains each (integer sums: any order is exact)
          for q in range(8):
            xl = builder.bitcast(_splat(builder, builder.load(_ptr(context, builder, t[5], x32, builder.add(
                xb, c(16 * p + q)), I32)), 16), v64b)
            xh = builder.bitcast(_splat(builder, builder.load(_ptr(context, builder, t[5], x32, builder.add(
                xb, c(16 * p + 8 + q)), I32)), 16), v64b)
            v = _ld(context, builder, t[0], W, builder.add(qb, c((p * 8 + q) * 64)), v64b)
            lo[q % 2] = _dpbusd(builder, lo[q % 2], builder.and_(v, ir.Constant(v64b, [15] * 64)), xl, vnni)
            hi[q % 2] = _dpbusd(builder, hi[q % 2], builder.lshr(v, ir.Constant(v64b, [4] * 64)), xh, vnni)
          lo, hi = builder.add(lo[0], lo[1]), builder.add(hi[0], hi[1])
          sv = [_i32x16(builder, _ld(context, builder, t[2], S, builder.add(ss, c(o + 16 * j)), v16b), False)
                for o, j in ((64, 2 * p), (64, 2 * p + 1), (192, 2 * p), (192, 2 * p + 1))]
          bl = _splat(builder, builder.add(bs[4 * p], bs[4 * p + 1]), 16)
          bh = _splat(builder, builder.add(bs[4 * p + 2], bs[4 * p + 3]), 16)
          ip = builder.add(builder.mul(lo, sv[0]), builder.mul(hi, sv[1]))
          im = builder.add(builder.mul(sv[2], bl), builder.mul(sv[3], bh))
          if pairs:
            builder.store(_fma(builder, builder.sitofp(ip, v16f), dwx, builder.load(A)), A)
            builder.store(_fma(builder, builder.sitofp(im, v16f), dmx, builder.load(M)), M)
          else:
            tot, totm = builder.add(tot, ip), builder.add(totm, im)
        if not pairs:
          builder.store(_fma(builder, builder.sitofp(tot, v16f), dwx, builder.load(A)), A)
          builder.store(_fma(builder, builder.sitofp(totm, v16f), dmx, builder.load(M)), M)
      res = builder.fsub(builder.load(A), builder.load(M))
      builder.store(res, _ptr(context, builder, t[9], out, builder.add(oo, c(16 * s)), v16f), align=4)
    return context.get_dummy_value()

  def _q56k(context, builder, sig, args, six: bool, tiled: bool):
    """matvec.q56k_rows as vector code, one sub-group of 16 rows at a time: vec_dot's eight lanes, or the tiled
    kernel's per-super-block sums."""
    W, qo, S, so, nb, x32, xo, kd, kbs, out, oo = args
    t = sig.args
    vnni = has_vnni()
    v16i, v16f, v64b, v16b, v16h = _vec(I32, 16), _vec(F32, 16), _vec(ir.IntType(8), 64), _vec(ir.IntType(8), 16), \
        _vec(ir.HalfType(), 16)
    zi, zf = ir.Constant(v16i, [0] * 16), ir.Constant(v16f, [0.0] * 16)
    c = lambda v: ir.Constant(I64, v)  # noqa: E731
    sgroup = 288 if six else 320
    for s in range(4):
      LA = [cgutils.alloca_once_value(builder, zf) for _ in range(1 if tiled else 8)]
      SM = cgutils.alloca_once_value(builder, zf)
      with cgutils.for_range(builder, nb) as loop:
        b = loop.index
        sbk = builder.add(builder.mul(nb, c(s)), b)  # (sub-group, super-block) index
        qb = builder.add(qo, builder.mul(sbk, c(4096)))
        ss = builder.add(so, builder.mul(sbk, c(sgroup)))
        dxs = builder.load(_ptr(context, builder, t[7], kd, b, F32))
        xb = builder.add(xo, builder.mul(b, c(64)))
        bsb = builder.mul(b, c(16))
        bs = [_splat(builder, builder.load(_ptr(context, builder, t[8], kbs, builder.add(bsb, c(j)), I32)), 16)
              for j in range(16)]
        sc_off = 32 if six else 64
        scs = [_i32x16(builder, _ld(context, builder, t[2], S, builder.add(ss, c(sc_off + 16 * j)), v16b), six)
               for j in range(16 if six else 8)]
        li = [zi] * 8
        for ch in range(8):
          for k in range(8):
            x = builder.bitcast(_splat(builder, builder.load(_ptr(context, builder, t[5], x32, builder.add(
                xb, c(8 * ch + k)), I32)), 16), v64b)
            v = _ld(context, builder, t[0], W, builder.add(qb, c((ch * 8 + k) * 64)), v64b)
            sc = scs[2 * ch + (1 if k >= 4 else 0)] if six else scs[ch]
            li[k] = builder.add(li[k], builder.mul(_dpbusd(builder, zi, v, x, vnni), sc))
        dw = builder.fpext(_ld(context, builder, t[2], S, ss, v16h), v16f)
        if six:  # 32 * (bsum * scale) of sub-blocks 2k, 2k+1 per lane k (the codes are stored +32)
          corr = [builder.mul(ir.Constant(v16i, [32] * 16), builder.add(builder.mul(bs[2 * k], scs[2 * k]),
                                                                        builder.mul(bs[2 * k + 1], scs[2 * k + 1])))
                  for k in range(8)]
          li = [builder.sub(li[k], corr[k]) for k in range(8)]
          im = None
        else:
          im = zi
          for j in range(8):
            m = _i32x16(builder, _ld(context, builder, t[2], S, builder.add(ss, c(192 + 16 * j)), v16b), False)
            im = builder.add(im, builder.mul(m, builder.add(bs[2 * j], bs[2 * j + 1])))
          dmw = builder.fpext(_ld(context, builder, t[2], S, builder.add(ss, c(32)), v16h), v16f)
        if tiled:
          s1 = li[0]
          for k in range(1, 8):
            s1 = builder.add(s1, li[k])
          rr = builder.fmul(builder.sitofp(s1, v16f), dw)
          if not six:
            rr = _fma(builder, builder.fneg(dmw), builder.sitofp(im, v16f), rr)
          builder.store(_fma(builder, rr, _splat(builder, dxs, 16), builder.load(LA[0])), LA[0])
        else:
          d = builder.fmul(_splat(builder, dxs, 16), dw)
          if not six:
            dmin = builder.fmul(_splat(builder, builder.fneg(dxs), 16), dmw)
            builder.store(_fma(builder, builder.sitofp(im, v16f), dmin, builder.load(SM)), SM)
          for k in range(8):
            builder.store(_fma(builder, d, builder.sitofp(li[k], v16f), builder.load(LA[k])), LA[k])
      if tiled:
        res = builder.load(LA[0])
      else:
        res = _hsum8(builder, [builder.load(a) for a in LA])
        if not six:
          res = builder.fadd(res, builder.load(SM))
      builder.store(res, _ptr(context, builder, t[9], out, builder.add(oo, c(16 * s)), v16f), align=4)
    return context.get_dummy_value()

  def _ksig(W, S, x32, kd, kbs, out):
    return nbt.void(W, nbt.int64, S, nbt.int64, nbt.int64, x32, nbt.int64, kd, kbs, out, nbt.int64)

  def _kintrinsic(gen):
    @intrinsic
    def f(typingctx, W, qo, S, so, nb, x32, xo, kd, kbs, out, oo):
      return _ksig(W, S, x32, kd, kbs, out), gen
    return f

  q4k_gemv = _kintrinsic(lambda c, b, s, a: _q4k(c, b, s, a, False))
  q4k_gemm = _kintrinsic(lambda c, b, s, a: _q4k(c, b, s, a, True))
  q6k_vec = _kintrinsic(lambda c, b, s, a: _q56k(c, b, s, a, True, False))
  q6k_tiled = _kintrinsic(lambda c, b, s, a: _q56k(c, b, s, a, True, True))
  q5k_vec = _kintrinsic(lambda c, b, s, a: _q56k(c, b, s, a, False, False))
  q5k_tiled = _kintrinsic(lambda c, b, s, a: _q56k(c, b, s, a, False, True))
