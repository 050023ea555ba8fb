"""LLVM-level building blocks for the numba kernels in ``planes_kernels.py`` (numba ``@intrinsic``s).

* ``q4_rows64`` / ``q8_rows64``: 64 output rows of a Q4_0 / Q8_0 mat-vec on the planes layout (planes.py), for
  one token. Integer block dots with AVX-512 VNNI ``vpdpbusd`` (u8 weights x s8 activations, 4 products per
  32-bit lane), then per block one fused multiply-add of the float block sum with (weight scale x activation
  scale) -- exactly the arithmetic of ggml's x86 kernels (Q4_0: the repacked gemv/gemm; Q8_0: vec_dot with its
  eight lane accumulators and their final tree sum), so the results are bit-identical to llama.cpp's. On a CPU
  without VNNI the same integer sums are written as plain vector IR (zext/sext, mul, add), same results.
* ``fma32``, ``half_to_float``, ``round_f16``: scalar helpers; ``prefetch``.
* ``atomic_add``, ``atomic_load``, ``cpu_relax``, ``sched_yield``: what the kernel threads' barrier needs.

``planes_kernels.py`` clears its numba cache when this file changes (numba only watches the caller's file).
"""
from __future__ import annotations

import os

try:
  from llvmlite import binding, ir
  from numba import types as nbt
  from numba.core import cgutils
  from numba.extending import intrinsic
  HAVE_NUMBA = True
except ImportError:  # pragma: no cover
  HAVE_NUMBA = False

  def intrinsic(f):  # noqa: D103
    return f

I8, I16, I32, I64 = (ir.IntType(n) for n in (8, 16, 32, 64)) if HAVE_NUMBA else (None,) * 4
F32 = ir.FloatType() if HAVE_NUMBA else None


def has_vnni() -> bool:
  if not HAVE_NUMBA or os.environ.get("ONDEVICE_VNNI", "1") == "0":
    return False
  return "+avx512vnni" in binding.get_host_cpu_features().flatten().split(",")


def _vec(t, n):
  return ir.VectorType(t, n)


def _ptr(context, builder, aryty, ary, offset, elt):
  """Pointer to ary[offset] (an element index), cast to ``elt*``."""
  a = context.make_array(aryty)(context, builder, ary)
  return builder.bitcast(builder.gep(a.data, [offset]), elt.as_pointer())


def _splat(builder, v, n):
  vt = _vec(v.type, n)
  u = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(I32, 0))
  return builder.shuffle_vector(u, ir.Constant(vt, ir.Undefined), ir.Constant(_vec(I32, n), [0] * n))


def _call(builder, name, ret, args):
  fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
  return builder.call(fn, args)


def _dpbusd(builder, acc, a_u8, b_s8, vnni):
  """acc[i] += sum_{j<4} u8(a[4i+j]) * s8(b[4i+j]) for 16 lanes (vpdpbusd, non-saturating)."""
  if vnni:
    return _call(builder, "llvm.x86.avx512.vpdpbusd.512", acc.type, [acc, a_u8, b_s8])
  p = builder.mul(builder.zext(a_u8, _vec(I32, 64)), builder.sext(b_s8, _vec(I32, 64)))
  for j in range(4):
    acc = builder.add(acc, builder.shuffle_vector(p, ir.Constant(_vec(I32, 64), ir.Undefined),
                                                  ir.Constant(_vec(I32, 16), [4 * i + j for i in range(16)])))
  return acc


def _fma(builder, a, b, c):
  return _call(builder, f"llvm.fma.{'v16f32' if isinstance(a.type, ir.VectorType) else 'f32'}", a.type, [a, b, c])


def _rows64(context, builder, sig, args, q4: bool):
  (wq, wq_off, sc, sc_off, nb, x32, x_off, xd, xs, xs_off, out, out_off) = args
  t = sig.args
  vnni = has_vnni()
  v16i, v16f, v64b, v16h = _vec(I32, 16), _vec(F32, 16), _vec(I8, 64), _vec(ir.HalfType(), 16)
  zero_i, zero_f = ir.Constant(v16i, [0] * 16), ir.Constant(v16f, [0.0] * 16)
  n_lanes = 1 if q4 else 8  # Q8_0 keeps ggml's eight lane accumulators per row
  acc = [[cgutils.alloca_once_value(builder, zero_f) for _ in range(n_lanes)] for _ in range(4)]
  blk_bytes = 1024 if q4 else 2048
  with cgutils.for_range(builder, nb) as loop:
    b = loop.index
    wbase = builder.add(wq_off, builder.mul(b, ir.Constant(I64, blk_bytes)))
    xb = builder.add(x_off, builder.mul(b, ir.Constant(I64, 8)))
    xs_b = builder.add(xs_off, builder.mul(b, ir.Constant(I64, 1 if q4 else 8)))
    xq = [_splat(builder, builder.load(_ptr(context, builder, t[5], x32, builder.add(xb, ir.Constant(I64, c)), I32)),
                 16) for c in range(8)]
    xq8 = [builder.bitcast(v, v64b) for v in xq]
    dx = _splat(builder, builder.load(_ptr(context, builder, t[7], xd, b, F32)), 16)
    for s in range(4):
      h = builder.load(_ptr(context, builder, t[2], sc, builder.add(sc_off, builder.add(
          builder.mul(b, ir.Constant(I64, 64)), ir.Constant(I64, 16 * s))), v16h), align=2)
      scale = builder.fmul(builder.fpext(h, v16f), dx)
      if q4:
        isum = zero_i
        for c in range(4):
          off = builder.add(wbase, ir.Constant(I64, 256 * s + 64 * c))
          v = builder.load(_ptr(context, builder, t[0], wq, off, v64b), align=1)
          lo = builder.and_(v, ir.Constant(v64b, [15] * 64))
          hi = builder.lshr(v, ir.Constant(v64b, [4] * 64))
          isum = _dpbusd(builder, isum, lo, xq8[c], vnni)
          isum = _dpbusd(builder, isum, hi, xq8[4 + c], vnni)
        corr = _splat(builder, builder.load(_ptr(context, builder, t[8], xs, xs_b, I32)), 16)
        f = builder.sitofp(builder.sub(isum, corr), v16f)
        builder.store(_fma(builder, f, scale, builder.load(acc[s][0])), acc[s][0])
      else:
        for c in range(8):
          off = builder.add(wbase, ir.Constant(I64, 512 * s + 64 * c))
          v = builder.load(_ptr(context, builder, t[0], wq, off, v64b), align=1)
          lane = _dpbusd(builder, zero_i, v, xq8[c], vnni)
          corr = _splat(builder, builder.load(_ptr(context, builder, t[8], xs, builder.add(
              xs_b, ir.Constant(I64, c)), I32)), 16)
          f = builder.sitofp(builder.sub(lane, corr), v16f)
          builder.store(_fma(builder, f, scale, builder.load(acc[s][c])), acc[s][c])
  for s in range(4):
    if q4:
      res = builder.load(acc[s][0])
    else:  # ggml's hsum_float_8 per row: ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7))
      ln = [builder.load(a) for a in acc[s]]
      tt = [builder.fadd(ln[4 + i], ln[i]) for i in range(4)]
      res = builder.fadd(builder.fadd(tt[0], tt[2]), builder.fadd(tt[1], tt[3]))
    dst = _ptr(context, builder, t[10], out, builder.add(out_off, ir.Constant(I64, 16 * s)), v16f)
    builder.store(res, dst, align=4)
  return context.get_dummy_value()


if HAVE_NUMBA:
  @intrinsic
  def q4_rows64(typingctx, wq, wq_off, sc, sc_off, nb, x32, x_off, xd, xs, xs_off, out, out_off):
    """out[out_off:+64] = 64 rows of a Q4_0 planes matrix (nibbles at wq[wq_off:], f16 scales at sc[sc_off:],
    nb blocks) times one Q8_0 activation (int8 quads x32[x_off:], scales xd[b], 8*sum(q) in xs[xs_off+b])."""
    sig = nbt.void(wq, nbt.int64, sc, nbt.int64, nbt.int64, x32, nbt.int64, xd, xs, nbt.int64, out, nbt.int64)
    return sig, lambda c, b, s, a: _rows64(c, b, s, a, True)

  @intrinsic
  def q8_rows64(typingctx, wq, wq_off, sc, sc_off, nb, x32, x_off, xd, xs, xs_off, out, out_off):
    """As q4_rows64 for Q8_0 (weights stored +128 as u8; xs[xs_off + 8b + c] = 128 * sum of quad c of block b)."""
    sig = nbt.void(wq, nbt.int64, sc, nbt.int64, nbt.int64, x32, nbt.int64, xd, xs, nbt.int64, out, nbt.int64)
    return sig, lambda c, b, s, a: _rows64(c, b, s, a, False)

  @intrinsic
  def fma32(typingctx, a, b, c):
    """Fused a*b + c in float32 (one rounding), as ggml's compiled C gets from -ffp-contract."""
    return nbt.float32(nbt.float32, nbt.float32, nbt.float32), lambda ctx, bld, s, args: _fma(bld, *args)

  @intrinsic
  def half_to_float(typingctx, h):
    """uint16 bit pattern of an IEEE half -> float32."""
    def codegen(context, builder, sig, args):
      return builder.fpext(builder.bitcast(args[0], ir.HalfType()), F32)
    return nbt.float32(nbt.uint16), codegen

  @intrinsic
  def round_f16(typingctx, x):
    """float32 -> nearest float16 -> float32 (ggml stores Q8_0 activation scales as f16)."""
    def codegen(context, builder, sig, args):
      return builder.fpext(builder.fptrunc(args[0], ir.HalfType()), F32)
    return nbt.float32(nbt.float32), codegen

  @intrinsic
  def prefetch(typingctx, arr, idx):
    """llvm.prefetch(&arr[idx]) for reading into all cache levels. Never faults."""
    def codegen(context, builder, sig, args):
      p = _ptr(context, builder, sig.args[0], args[0], args[1], I8)
      _call(builder, "llvm.prefetch.p0", ir.VoidType(), [p, ir.Constant(I32, 0), ir.Constant(I32, 3),
                                                         ir.Constant(I32, 1)])
      return context.get_dummy_value()
    return nbt.void(arr, idx), codegen

  @intrinsic
  def atomic_add(typingctx, arr, idx, val):
    """Sequentially consistent arr[idx] += val on an int64 array; returns the old value."""
    def codegen(context, builder, sig, args):
      p = _ptr(context, builder, sig.args[0], args[0], args[1], I64)
      return builder.atomic_rmw("add", p, args[2], "seq_cst")
    return nbt.int64(arr, idx, nbt.int64), codegen

  @intrinsic
  def atomic_load(typingctx, arr, idx):
    def codegen(context, builder, sig, args):
      p = _ptr(context, builder, sig.args[0], args[0], args[1], I64)
      return builder.load_atomic(p, "seq_cst", 8)
    return nbt.int64(arr, idx), codegen

  @intrinsic
  def cpu_relax(typingctx):
    """The x86 ``pause`` hint in spin loops (a no-op elsewhere)."""
    def codegen(context, builder, sig, args):
      if "x86" in binding.get_default_triple():
        _call(builder, "llvm.x86.sse2.pause", ir.VoidType(), [])
      return context.get_dummy_value()
    return nbt.void(), codegen

  @intrinsic
  def sched_yield(typingctx):
    """libc sched_yield(): lets another runnable thread have this core (spin-wait back-off)."""
    def codegen(context, builder, sig, args):
      return _call(builder, "sched_yield", I32, [])
    return nbt.int32(), codegen


# ------------------------------------------------------------------------------------------ float vectors

def _f32_ptr(context, builder, aryty, ary, off, n=16):
  return _ptr(context, builder, aryty, ary, off, _vec(F32, n) if n > 1 else F32)


def _reduce16(builder, v):
  """_mm512_reduce_add_ps as GCC emits it: (hi8 + lo8), then (hi4 + lo4), then (0+2) + (1+3)."""
  def part(vec, idx):
    return builder.shuffle_vector(vec, ir.Constant(vec.type, ir.Undefined), ir.Constant(_vec(I32, len(idx)), idx))
  t8 = builder.fadd(part(v, list(range(8, 16))), part(v, list(range(8))))
  t4 = builder.fadd(part(t8, [4, 5, 6, 7]), part(t8, [0, 1, 2, 3]))
  t2 = builder.fadd(t4, part(t4, [2, 3, 0, 1]))
  lane = lambda i: builder.extract_element(t2, ir.Constant(I32, i))  # noqa: E731
  return builder.fadd(lane(0), lane(1))


def _expf16(builder, x):
  """ggml_v_expf on 16 lanes (same operations, same order; 2^n applied exactly, as vscalefps does)."""
  v16f = _vec(F32, 16)
  c = lambda h: ir.Constant(v16f, [float.fromhex(h)] * 16)  # noqa: E731
  shift = c("0x1.8p23")
  z = _fma(builder, x, c("0x1.715476p+0"), shift)
  n = builder.fsub(z, shift)
  neg = builder.fneg(n)
  b = _fma(builder, neg, c("0x1.7f7d1cp-20"), _fma(builder, neg, c("0x1.62e4p-1"), x))
  u = builder.fmul(b, b)
  j = _fma(builder, _fma(builder, _fma(builder, c("0x1.0e4020p-7"), b, c("0x1.573e2ep-5")), u,
                         _fma(builder, c("0x1.555e66p-3"), b, c("0x1.fffdb6p-2"))), u,
           _fma(builder, c("0x1.ffffecp-1"), b, ir.Constant(v16f, [1.0] * 16)))
  # 2^n exactly: n is integral and |n| <= 192 where used, so build the double 2^n from its exponent bits.
  v16d, v16l = _vec(ir.DoubleType(), 16), _vec(I64, 16)
  ni = builder.fptosi(builder.fpext(n, v16d), v16l)
  big = builder.fcmp_ordered(">", _call(builder, "llvm.fabs.v16f32", v16f, [n]), ir.Constant(v16f, [192.0] * 16))
  ni = builder.select(big, ir.Constant(v16l, [0] * 16), ni)
  p2 = builder.bitcast(builder.shl(builder.add(ni, ir.Constant(v16l, [1023] * 16)), ir.Constant(v16l, [52] * 16)), v16d)
  res = builder.fptrunc(builder.fmul(builder.fpext(j, v16d), p2), v16f)
  alt = builder.select(builder.fcmp_ordered("<=", n, ir.Constant(v16f, [0.0] * 16)), ir.Constant(v16f, [0.0] * 16),
                       ir.Constant(v16f, [float("inf")] * 16))
  return builder.select(big, alt, res)


if HAVE_NUMBA:
  @intrinsic
  def vdot_f32(typingctx, x, xo, y, yo, n):
    """ggml_vec_dot_f32 on AVX-512: 4 x 16-lane fma accumulators over 64-element steps, (0+2)+(1+3), the
    16-lane tree sum, then the leftovers as GCC compiled them (see below)."""
    def codegen(context, builder, sig, args):
      xa, xo_, ya, yo_, n_ = args
      v16f = _vec(F32, 16)
      acc = [cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16)) for _ in range(4)]
      n64 = builder.and_(n_, ir.Constant(I64, ~63))
      with cgutils.for_range_slice(builder, ir.Constant(I64, 0), n64, ir.Constant(I64, 64), inc=True) as (i, _):
        for j in range(4):
          o = builder.add(i, ir.Constant(I64, 16 * j))
          xv = builder.load(_f32_ptr(context, builder, sig.args[0], xa, builder.add(xo_, o)), align=4)
          yv = builder.load(_f32_ptr(context, builder, sig.args[2], ya, builder.add(yo_, o)), align=4)
          builder.store(_fma(builder, xv, yv, builder.load(acc[j])), acc[j])
      a = [builder.load(p) for p in acc]
      s = cgutils.alloca_once_value(builder, _reduce16(builder, builder.fadd(builder.fadd(a[0], a[2]),
                                                                             builder.fadd(a[1], a[3]))))
      # The leftovers loop `sumf += x[i]*y[i]` as GCC vectorised it: blocks of 16 (when >= 16 are left) and then one
      # of 8 are multiplied, then added one by one (no fma); the last < 8 are scalar fmas.
      r = builder.sub(n_, n64)
      e16 = builder.add(n64, builder.select(builder.icmp_signed(">=", r, ir.Constant(I64, 16)),
                                            builder.and_(r, ir.Constant(I64, ~15)), ir.Constant(I64, 0)))
      rem = builder.sub(n_, e16)
      e8 = builder.add(e16, builder.select(builder.icmp_signed(">=", rem, ir.Constant(I64, 8)), ir.Constant(I64, 8),
                                           ir.Constant(I64, 0)))

      def term(i):
        xv = builder.load(_f32_ptr(context, builder, sig.args[0], xa, builder.add(xo_, i), 1))
        yv = builder.load(_f32_ptr(context, builder, sig.args[2], ya, builder.add(yo_, i), 1))
        return xv, yv

      with cgutils.for_range_slice(builder, n64, e8, ir.Constant(I64, 1), inc=True) as (i, _):
        xv, yv = term(i)
        builder.store(builder.fadd(builder.load(s), builder.fmul(xv, yv)), s)
      with cgutils.for_range_slice(builder, e8, n_, ir.Constant(I64, 1), inc=True) as (i, _):
        xv, yv = term(i)
        builder.store(_fma(builder, xv, yv, builder.load(s)), s)
      return builder.load(s)
    return nbt.float32(x, nbt.int64, y, nbt.int64, nbt.int64), codegen

  @intrinsic
  def vaxpy(typingctx, acc, ao, a, v, vo, n16):
    """acc[ao + i] = fma(a, v[vo + i], acc[ao + i]) for i < 16 * n16 (16-lane vectors)."""
    def codegen(context, builder, sig, args):
      acc_a, ao_, a_, v_a, vo_, n_ = args
      av = _splat(builder, a_, 16)
      with cgutils.for_range(builder, n_) as loop:
        o = builder.mul(loop.index, ir.Constant(I64, 16))
        pa = _f32_ptr(context, builder, sig.args[0], acc_a, builder.add(ao_, o))
        pv = _f32_ptr(context, builder, sig.args[3], v_a, builder.add(vo_, o))
        builder.store(_fma(builder, av, builder.load(pv, align=4), builder.load(pa, align=4)), pa, align=4)
      return context.get_dummy_value()
    return nbt.void(acc, nbt.int64, nbt.float32, v, nbt.int64, nbt.int64), codegen

  @intrinsic
  def vexp_sum(typingctx, x, m, n16):
    """x[i] = ggml_v_expf(x[i] - m) for i < 16 * n16, returning the double sum of the 16-lane tree sums (what
    ggml_vec_soft_max_f32 accumulates). Lanes past the real length must hold -inf (they give 0)."""
    def codegen(context, builder, sig, args):
      xa, m_, n_ = args
      mv = _splat(builder, m_, 16)
      tot = cgutils.alloca_once_value(builder, ir.Constant(ir.DoubleType(), 0.0))
      with cgutils.for_range(builder, n_) as loop:
        px = _f32_ptr(context, builder, sig.args[0], xa, builder.mul(loop.index, ir.Constant(I64, 16)))
        e = _expf16(builder, builder.fsub(builder.load(px, align=4), mv))
        builder.store(e, px, align=4)
        builder.store(builder.fadd(builder.load(tot), builder.fpext(_reduce16(builder, e), ir.DoubleType())), tot)
      return builder.load(tot)
    return nbt.float64(x, nbt.float32, nbt.int64), codegen

  @intrinsic
  def vswiglu(typingctx, g, go, u, uo, out, oo, n16):
    """out[oo + i] = g / (1 + ggml_v_expf(0 - g)) * u, 16 lanes at a time (ggml_vec_swiglu_f32)."""
    def codegen(context, builder, sig, args):
      ga, go_, ua, uo_, oa, oo_, n_ = args
      v16f = _vec(F32, 16)
      with cgutils.for_range(builder, n_) as loop:
        o = builder.mul(loop.index, ir.Constant(I64, 16))
        gv = builder.load(_f32_ptr(context, builder, sig.args[0], ga, builder.add(go_, o)), align=4)
        uv = builder.load(_f32_ptr(context, builder, sig.args[2], ua, builder.add(uo_, o)), align=4)
        e = _expf16(builder, builder.fsub(ir.Constant(v16f, [0.0] * 16), gv))
        s = builder.fdiv(gv, builder.fadd(ir.Constant(v16f, [1.0] * 16), e))
        builder.store(builder.fmul(s, uv), _f32_ptr(context, builder, sig.args[4], oa, builder.add(oo_, o)), align=4)
      return context.get_dummy_value()
    return nbt.void(g, nbt.int64, u, nbt.int64, out, nbt.int64, nbt.int64), codegen


if HAVE_NUMBA:
  @intrinsic
  def f32_ptr(typingctx, addr):
    """An int64 address -> float32* (for numba.carray over memory the caller keeps alive)."""
    def codegen(context, builder, sig, args):
      return builder.inttoptr(args[0], F32.as_pointer())
    return nbt.CPointer(nbt.float32)(nbt.int64), codegen

  @intrinsic
  def usleep(typingctx, us):
    """libc usleep(us): an idle kernel thread naps instead of spinning on a shared machine."""
    def codegen(context, builder, sig, args):
      return _call(builder, "usleep", I32, [builder.trunc(args[0], I32)])
    return nbt.int32(nbt.int64), codegen


SYS_FUTEX, FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 202, 128, 129  # x86-64 Linux


if HAVE_NUMBA:
  def _futex(builder, context, aryty, ary, idx, op, val):
    p = _ptr(context, builder, aryty, ary, idx, I8)
    fnty = ir.FunctionType(I64, [I64], var_arg=True)
    fn = cgutils.get_or_insert_function(builder.module, fnty, "syscall")
    null = ir.Constant(I8.as_pointer(), None)
    return builder.call(fn, [ir.Constant(I64, SYS_FUTEX), p, ir.Constant(I32, op), builder.trunc(val, I32), null, null,
                             ir.Constant(I32, 0)])

  @intrinsic
  def futex_wait(typingctx, arr, idx, expected):
    """Sleep while the low 32 bits of int64 arr[idx] equal ``expected`` (Linux futex; returns at once if not)."""
    def codegen(context, builder, sig, args):
      return _futex(builder, context, sig.args[0], args[0], args[1], FUTEX_WAIT_PRIVATE, args[2])
    return nbt.int64(arr, idx, nbt.int64), codegen

  @intrinsic
  def futex_wake(typingctx, arr, idx, n):
    """Wake up to n threads sleeping in futex_wait on arr[idx]."""
    def codegen(context, builder, sig, args):
      return _futex(builder, context, sig.args[0], args[0], args[1], FUTEX_WAKE_PRIVATE, args[2])
    return nbt.int64(arr, idx, nbt.int64), codegen
