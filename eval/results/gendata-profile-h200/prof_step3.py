import torch
import transformers.integrations.sdpa_attention as s
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)
m = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval(); m.config._attn_implementation = "sdpa"
s.use_gqa_in_sdpa = lambda *a, **k: True
for B in (1024, 2048, 4096):
    cache = StaticCache(config=cfg, max_batch_size=B, max_cache_len=512, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 49152, (B, 1), device="cuda"); cp = torch.tensor([300], device="cuda")
    with torch.inference_mode():
        m(ids, past_key_values=cache, cache_position=cp, use_cache=True); torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            m(ids, past_key_values=cache, cache_position=cp, use_cache=True); torch.cuda.synchronize()
    ev = p.key_averages(); tot = sum(e.self_device_time_total for e in ev) / 1e3
    top = sorted(ev, key=lambda e: -e.self_device_time_total)[:3]
    print(f"B={B}: GPU {tot:.2f} ms/step -> {B/tot*1e3:,.0f} tok/s; top: " + "; ".join(f"{e.key[:50]} {e.self_device_time_total/1e3:.2f}ms" for e in top), flush=True)
