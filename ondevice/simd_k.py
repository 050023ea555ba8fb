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
