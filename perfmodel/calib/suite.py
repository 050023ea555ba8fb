"""The programs calibration and validation run: each entry is a dict of config overrides on top of BASE (same keys
as experiment configs).

``SUITE`` / ``INFER``: the validation suite, training configs varied in width, depth, sequence, batch, layout and
remat (small latency-bound ones included), and KV-cached decode configs. ``CALIBRATION`` / ``CALIBRATION_INFER``: the
programs the model is fitted on, with shapes disjoint from the validation suite, so validation stays a held-out
test."""

BASE = dict(
    model=dict(vocab_size=256, d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=384, max_seq_len=256,
               remat="none", scan_layers=True),
    data=dict(seq_len=64, global_batch=8),
    mesh=dict(data=1, tensor=1, fsdp=1),
    train=dict(steps=10),
)

SUITE = [
    dict(name="tiny_latency", model=dict(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64),
         data=dict(seq_len=16, global_batch=2)),
    dict(name="base"),
    dict(name="wide256", model=dict(d_model=256, d_ff=768, n_heads=8, n_kv_heads=4)),
    dict(name="wide384", model=dict(d_model=384, d_ff=1024, n_heads=8, n_kv_heads=4), data=dict(global_batch=4)),
    dict(name="deep4", model=dict(n_layers=4)),
    dict(name="deep8_narrow", model=dict(n_layers=8, d_model=64, d_ff=192, n_heads=4, n_kv_heads=2)),
    dict(name="seq128", data=dict(seq_len=128)),
    dict(name="seq32_b16", data=dict(seq_len=32, global_batch=16)),
    dict(name="batch32", data=dict(global_batch=32)),
    dict(name="remat_full", model=dict(remat="full")),
    dict(name="remat_dots", model=dict(remat="dots", n_layers=4)),
    dict(name="dp2", mesh=dict(data=2)),
    dict(name="tp2", mesh=dict(tensor=2)),
    dict(name="dp2_tp2", mesh=dict(data=2, tensor=2), data=dict(global_batch=16)),
    dict(name="pp2", mesh=dict(pipeline=2, microbatches=4, schedule="gpipe", form="shard_map")),
]

INFER = [
    dict(name="decode_b1", batch=1, prompt_len=32, gen_lens=(8, 56)),
    dict(name="decode_b4", batch=4, prompt_len=32, gen_lens=(8, 56)),
    dict(name="decode_b8_wide", batch=8, prompt_len=64, gen_lens=(8, 56), model=dict(d_model=256, d_ff=768,
                                                                                     n_heads=8, n_kv_heads=4)),
]

# Calibration programs for the learned backend (`python -m perfmodel calibrate`): real training steps whose
# shapes differ from every SUITE entry (other widths, sequence lengths, batches), spanning the same range, so
# validation stays a held-out test. Their per-node in-program times train the learned backend; their step
# times fit how node times compose into a step (per-node gap, per-device and collective terms).
CALIBRATION = [
    dict(name="c_d48_l1", model=dict(d_model=48, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=96),
         data=dict(seq_len=24, global_batch=3)),
    # a second latency-bound program: with one alone, leaving it out makes the composition extrapolate (measured:
    # the fit without c_d48_l1 took a 7 ms per-step constant from the 24+ ms programs and missed it by +673%)
    dict(name="c_d24_l2", model=dict(d_model=24, n_layers=2, n_heads=2, n_kv_heads=2, d_ff=64),
         data=dict(seq_len=20, global_batch=2)),
    # below the validation's smallest step: with the two programs above (1.05-1.13 ms) the smallest, tiny_latency
    # (0.53 ms) would be an extrapolation of the per-step constant. Smaller than tiny_latency in every dimension,
    # so the latency-bound end is bracketed, not matched.
    dict(name="c_d16_l1", model=dict(d_model=16, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=48),
         data=dict(seq_len=12, global_batch=2)),
    dict(name="c_d96_l3", model=dict(d_model=96, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=256),
         data=dict(seq_len=48, global_batch=6)),
    dict(name="c_d160", model=dict(d_model=160, n_heads=4, n_kv_heads=2, d_ff=448), data=dict(seq_len=96)),
    dict(name="c_d192_b12", model=dict(d_model=192, n_heads=6, n_kv_heads=3, d_ff=512),
         data=dict(seq_len=48, global_batch=12)),
    dict(name="c_d320_b3", model=dict(d_model=320, n_heads=8, n_kv_heads=4, d_ff=896),
         data=dict(seq_len=96, global_batch=3)),
    dict(name="c_d448_s40", model=dict(d_model=448, n_heads=8, n_kv_heads=4, d_ff=1280),
         data=dict(seq_len=40, global_batch=4)),
    dict(name="c_d96_s192", model=dict(d_model=96, n_heads=4, n_kv_heads=2, d_ff=256),
         data=dict(seq_len=192, global_batch=4)),
    dict(name="c_d80_l6", model=dict(d_model=80, n_layers=6, n_heads=4, n_kv_heads=2, d_ff=224),
         data=dict(seq_len=40, global_batch=6)),
    dict(name="c_remat_full_d96", model=dict(d_model=96, n_heads=4, n_kv_heads=2, d_ff=256, remat="full"),
         data=dict(seq_len=48, global_batch=12)),
    dict(name="c_remat_dots_d160", model=dict(d_model=160, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=448,
                                              remat="dots"), data=dict(seq_len=48)),
    dict(name="c_dp2_d96", model=dict(d_model=96, n_heads=4, n_kv_heads=2, d_ff=256), data=dict(seq_len=48),
         mesh=dict(data=2)),
    dict(name="c_tp2_d192", model=dict(d_model=192, n_heads=6, n_kv_heads=2, d_ff=512), data=dict(seq_len=48),
         mesh=dict(tensor=2)),
    dict(name="c_dp2_tp2_d160", model=dict(d_model=160, n_heads=4, n_kv_heads=2, d_ff=448),
         data=dict(seq_len=40, global_batch=12), mesh=dict(data=2, tensor=2)),
    dict(name="c_dp4_d64", model=dict(d_model=64, n_heads=4, n_kv_heads=2, d_ff=160), data=dict(seq_len=24, global_batch=8),
         mesh=dict(data=4)),
    # mid-width programs (d 112-144): the validation suite's widths sit between d96 and d160 above
    dict(name="c_d112_s72", model=dict(d_model=112, n_heads=4, n_kv_heads=2, d_ff=320), data=dict(seq_len=72)),
    dict(name="c_d144_l3_b6", model=dict(d_model=144, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=416),
         data=dict(seq_len=56, global_batch=6)),
    dict(name="c_remat_full_d144", model=dict(d_model=144, n_heads=4, n_kv_heads=2, d_ff=416, remat="full"),
         data=dict(seq_len=56)),
    dict(name="c_tp2_d144", model=dict(d_model=144, n_heads=4, n_kv_heads=2, d_ff=416), data=dict(seq_len=56),
         mesh=dict(tensor=2)),
    # many tokens per step (1152-1536; the rest stop at 768): the validation's seq128 (1024 tokens) and batch32
    # (2048) must not lie outside the calibration's range
    dict(name="c_d112_b24", model=dict(d_model=112, n_heads=4, n_kv_heads=2, d_ff=320),
         data=dict(seq_len=64, global_batch=24)),
    dict(name="c_d176_s144", model=dict(d_model=176, n_heads=4, n_kv_heads=2, d_ff=480),
         data=dict(seq_len=144, global_batch=8)),
    # power-of-two token counts (512-2048), as real configs (and the validation suite) use them, at widths no
    # validation config has. Every program above avoids powers of two, and XLA:CPU is shape-specific: these
    # programs' nodes run 1.2-1.65x their physical estimate relative to the same node classes in the programs above.
    dict(name="c_p2_d192_s64_b16", model=dict(d_model=192, n_heads=6, n_kv_heads=3, d_ff=512),
         data=dict(seq_len=64, global_batch=16)),
    dict(name="c_p2_d96_s128_b4", model=dict(d_model=96, n_heads=4, n_kv_heads=2, d_ff=256),
         data=dict(seq_len=128, global_batch=4)),
    dict(name="c_p2_d160_s32_b32", model=dict(d_model=160, n_heads=4, n_kv_heads=2, d_ff=448),
         data=dict(seq_len=32, global_batch=32)),
    dict(name="c_p2_d112_s64_b32", model=dict(d_model=112, n_heads=4, n_kv_heads=2, d_ff=320),
         data=dict(seq_len=64, global_batch=32)),
    dict(name="c_p2_d80_s256_b2_l3", model=dict(d_model=80, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=256),
         data=dict(seq_len=256, global_batch=2)),
    # pipelined programs (shard_map form: idle slots skipped with lax.cond, resolved by perfmodel/pipeline.py)
    dict(name="c_pp2_d96", model=dict(d_model=96, n_heads=4, n_kv_heads=2, d_ff=256), data=dict(seq_len=48),
         mesh=dict(pipeline=2, microbatches=4, schedule="gpipe", form="shard_map")),
    dict(name="c_pp2_1f1b_d160", model=dict(d_model=160, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=448),
         data=dict(seq_len=40), mesh=dict(pipeline=2, microbatches=4, schedule="1f1b", form="shard_map")),
]

# Calibration decode programs (KV-cached sampler), shapes disjoint from INFER. Generation lengths 8 and 56 as in
# INFER: the TPOT slope over 48 tokens repeats within ±2% on this host, over 12 tokens (6 vs 18) within ±17-30%.
CALIBRATION_INFER = [
    dict(name="c_decode_b2", batch=2, prompt_len=24, gen_lens=(8, 56), model=dict(d_model=96, n_heads=4, n_kv_heads=2,
                                                                                 d_ff=256)),
    dict(name="c_decode_b6", batch=6, prompt_len=48, gen_lens=(8, 56), model=dict(d_model=192, n_heads=6, n_kv_heads=3,
                                                                                 d_ff=512)),
    dict(name="c_decode_b1_d64", batch=1, prompt_len=16, gen_lens=(8, 56), model=dict(d_model=64, n_heads=4,
                                                                                     n_kv_heads=2, d_ff=160)),
    dict(name="c_decode_b3_d320", batch=3, prompt_len=40, gen_lens=(8, 56), model=dict(d_model=320, n_heads=8,
                                                                                      n_kv_heads=4, d_ff=896)),
    dict(name="c_decode_b10_d224", batch=10, prompt_len=56, gen_lens=(8, 56), model=dict(d_model=224, n_heads=8,
                                                                                        n_kv_heads=4, d_ff=640)),
    # between 4 and 24 MB moved per step, where the validation decode configs sit
    dict(name="c_decode_b2_d160_l3", batch=2, prompt_len=40, gen_lens=(8, 56), model=dict(
        d_model=160, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=448)),
    dict(name="c_decode_b5_d112", batch=5, prompt_len=24, gen_lens=(8, 56), model=dict(d_model=112, n_heads=4,
                                                                                      n_kv_heads=2, d_ff=320)),
    # a second batch-1 program: with c_decode_b1_d64 alone (0.04 ms), a batch-1 step of a few MB has no neighbour of
    # its kind
    dict(name="c_decode_b1_d176", batch=1, prompt_len=24, gen_lens=(8, 56), model=dict(d_model=176, n_heads=4,
                                                                                      n_kv_heads=2, d_ff=480)),
    # power-of-two batches and prompts (as the training programs above)
    dict(name="c_decode_p2_b8_d192", batch=8, prompt_len=32, gen_lens=(8, 56), model=dict(d_model=192, n_heads=6,
                                                                                         n_kv_heads=3, d_ff=512)),
    dict(name="c_decode_p2_b2_d320", batch=2, prompt_len=64, gen_lens=(8, 56), model=dict(d_model=320, n_heads=8,
                                                                                         n_kv_heads=4, d_ff=1024)),
    # power-of-two widths: every other decode program but c_decode_b1_d64 has a width that is not a
    # power of two, while XLA:CPU's kernels are shape-specific (as the training programs' power-of-two term shows)
    dict(name="c_decode_w128_b6", batch=6, prompt_len=24, gen_lens=(8, 56), model=dict(d_model=128, n_heads=4,
                                                                                      n_kv_heads=2, d_ff=512)),
    dict(name="c_decode_w256_b3", batch=3, prompt_len=40, gen_lens=(8, 56), model=dict(d_model=256, n_heads=8,
                                                                                      n_kv_heads=4, d_ff=640)),
]
