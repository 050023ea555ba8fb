"""Default validation suite: training configs varied in width, depth, sequence, batch, layout and remat
(small latency-bound ones included), plus KV-cached inference configs. Each entry is a dict of config
overrides on top of BASE (same keys as experiment configs)."""

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
]

INFER = [
    dict(name="decode_b1", batch=1, prompt_len=32, gen_lens=(8, 24)),
    dict(name="decode_b4", batch=4, prompt_len=32, gen_lens=(8, 24)),
    dict(name="decode_b8_wide", batch=8, prompt_len=64, gen_lens=(8, 24), model=dict(d_model=256, d_ff=768,
                                                                                     n_heads=8, n_kv_heads=4)),
]
