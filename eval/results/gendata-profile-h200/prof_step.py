import torch, time
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)
m = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
for impl in ("sdpa", "eager"):
    m.config._attn_implementation = impl
    for B in (1024,):
        cache = StaticCache(config=cfg, max_batch_size=B, max_cache_len=512, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, 49152, (B, 1), device="cuda")
        with torch.inference_mode():
            for pos in (10, 300):
                cp = torch.tensor([pos], device="cuda")
                m(ids, past_key_values=cache, cache_position=cp, use_cache=True); torch.cuda.synchronize()
                s = time.perf_counter()
                for _ in range(10): m(ids, past_key_values=cache, cache_position=cp, use_cache=True)
                torch.cuda.synchronize(); print(f"{impl} B={B} pos={pos}: {(time.perf_counter()-s)/10*1e3:.2f} ms/step", flush=True)
        with torch.inference_mode(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            m(ids, past_key_values=cache, cache_position=torch.tensor([300], device="cuda"), use_cache=True); torch.cuda.synchronize()
        print(p.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
