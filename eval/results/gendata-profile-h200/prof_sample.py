import torch, time
torch.manual_seed(0)
dev="cuda"
def t(f, n=20):
    f(); torch.cuda.synchronize(); s=time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter()-s)/n*1e3
for B in (256,1024,2048):
    logits = torch.randn(B, 49152, device=dev)*3
    h = torch.randn(B, 576, device=dev, dtype=torch.bfloat16); W=torch.randn(49152,576,device=dev,dtype=torch.bfloat16)
    def lm(): return (h@W.T).float()
    def srt(): return torch.sort(logits/0.8, dim=-1, descending=True)
    def nucleus():
        v,i = torch.sort(logits/0.8, dim=-1, descending=True); p=v.softmax(-1); c=p.cumsum(-1)
        keep = (c-p) < 0.95; p=p*keep; q=torch.empty_like(p).exponential_(); return i.gather(-1,(p/q).argmax(-1,keepdim=True))
    def topk():
        v,i = torch.topk(logits/0.8, 1024, dim=-1); return v
    print(f"B={B}: lm_head {t(lm):.2f} ms  sort {t(srt):.2f} ms  nucleus(sort) {t(nucleus):.2f} ms  topk1024 {t(topk):.2f} ms", flush=True)
