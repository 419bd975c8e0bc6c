import torch, time
import torch.nn.functional as F
def t(f, n=20):
    f(); torch.cuda.synchronize(); s=time.perf_counter()
    for _ in range(n): f()
    torch.cuda.synchronize(); return (time.perf_counter()-s)/n*1e3
B,Hk,G,L,D=1024,3,3,512,64
k=torch.randn(B,Hk,L,D,device="cuda",dtype=torch.bfloat16); v=torch.randn_like(k)
q=torch.randn(B,Hk*G,1,D,device="cuda",dtype=torch.bfloat16)
mask=torch.zeros(B,1,1,L,device="cuda",dtype=torch.bool); mask[...,:301]=True
def rep(): 
    kk=k[:,:,None].expand(B,Hk,G,L,D).reshape(B,Hk*G,L,D); vv=v[:,:,None].expand(B,Hk,G,L,D).reshape(B,Hk*G,L,D)
    return F.scaled_dot_product_attention(q,kk,vv,attn_mask=mask)
def gqa(): return F.scaled_dot_product_attention(q,k,v,attn_mask=mask,enable_gqa=True)
def fold():
    o=F.scaled_dot_product_attention(q.view(B,Hk,G,D),k,v,attn_mask=mask); return o.reshape(B,Hk*G,1,D)
a,b,c=rep(),gqa(),fold()
print("maxdiff gqa",(a-b).abs().max().item(),"fold",(a-c).abs().max().item())
print(f"repeat_kv+sdpa {t(rep):.3f} ms  enable_gqa {t(gqa):.3f} ms  fold-groups-into-q {t(fold):.3f} ms  (x30 layers)")
