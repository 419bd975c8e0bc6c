import torch, time, inspect
from transformers import StaticCache
def t(f, n=20):
    f(); torch.cuda.synchronize(); s=time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter()-s)/n*1e3
B,H,L,D=1024,3,512,64
k=torch.zeros(B,H,L,D,device="cuda",dtype=torch.bfloat16); new=torch.randn(B,H,1,D,device="cuda",dtype=torch.bfloat16)
pos=torch.tensor([300],device="cuda")
print("index_copy_", t(lambda: k.index_copy_(2,pos,new)))
def sl(): k[:,:,300:301]=new
print("slice assign", t(sl))
print("copy whole", t(lambda: k.copy_(k.clone())))
from transformers import cache_utils
src=inspect.getsource(cache_utils)
i=src.find("class StaticLayer"); j=src.find("def update", i); print(src[j:j+1800])
