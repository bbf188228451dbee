import json, sys, torch
from smmf import SMMF
torch.manual_seed(0)
shapes = [(4096, 4096)] * 8 + [(1600, 6400)] * 4 + [(50257, 1600)]
params = [torch.nn.Parameter(torch.randn(s, device="cuda") * 0.02) for s in shapes]
for p in params:
    p.grad = torch.randn_like(p) * 1e-3
opts = {"smmf": SMMF(params, lr=1e-6, backend="triton")}
if sys.argv[1] == "HEAD":
    opts["adamw"] = torch.optim.AdamW(params, lr=1e-9, fused=True)
    a, b = torch.zeros(sum(p.numel() for p in params), device="cuda"), torch.ones(sum(p.numel() for p in params), device="cuda")
    opts["axpy"] = type("A", (), {"step": lambda self: a.add_(b, alpha=1e-9)})()
for o in opts.values():
    for _ in range(3):
        o.step()
torch.cuda.synchronize()
res = {k: [] for k in opts}
for _ in range(15):
    for k, o in opts.items():
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(); s.record(); o.step(); e.record(); e.synchronize()
        res[k].append(s.elapsed_time(e))
print(json.dumps({"commit": sys.argv[1], **{k: sorted(v)[len(v) // 2] for k, v in res.items()}}), flush=True)
