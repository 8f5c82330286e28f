"""Probe: torch._int_mm layouts vs bf16 for Flux shapes (H100)."""
import torch
def t(fn, n=50):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(n): fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n
M = 4608
for (N, K) in [(3072, 3072), (12288, 3072), (3072, 12288), (3072, 15360), (9216, 3072)]:
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    xq = torch.randint(-127, 127, (M, K), device="cuda", dtype=torch.int8)
    wq = torch.randint(-127, 127, (N, K), device="cuda", dtype=torch.int8)
    gq = torch.randint(-127, 127, (M, N), device="cuda", dtype=torch.int8)
    g = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    bf_f = t(lambda: x @ w.t())
    bf_b = t(lambda: g @ w)
    i_tn = t(lambda: torch._int_mm(xq, wq.t()))
    i_nn = t(lambda: torch._int_mm(gq, wq))
    wqt = wq.t().contiguous()
    i_nn2 = t(lambda: torch._int_mm(gq, wqt.t()))
    fl = 2 * M * N * K / 1e9
    print(f"N={N} K={K}: bf16 fwd {bf_f:.3f} ms ({fl/bf_f:.0f} TF) bwd {bf_b:.3f}; int8 TN {i_tn:.3f} ({fl/i_tn:.0f} TOPS) NN {i_nn:.3f} ({fl/i_nn:.0f}) NN-pretransposed {i_nn2:.3f}")
# scaled_mm fp8 rowwise as alternative
try:
    x8 = torch.randn(M, 3072, device="cuda").to(torch.float8_e4m3fn)
    w8 = torch.randn(12288, 3072, device="cuda").to(torch.float8_e4m3fn)
    sa = torch.ones(M, 1, device="cuda")
    sb = torch.ones(1, 12288, device="cuda")
    f8 = t(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
    print(f"fp8 rowwise scaled_mm 12288x3072: {f8:.3f} ms ({2*M*12288*3072/1e9/f8:.0f} TF)")
except Exception as ex:
    print("fp8 scaled_mm failed", ex)
