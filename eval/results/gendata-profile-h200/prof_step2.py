import torch, time, sys
import transformers.integrations.sdpa_attention as s
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache
cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)
m = LlamaForCausalLM(cfg).cuda().to(torch.bfloat16).eval()
m.config._attn_implementation = "sdpa"
orig = s.use_gqa_in_sdpa
for force in (False, True):
    s.use_gqa_in_sdpa = (lambda *a, **k: True) if force else orig
    for B in (1024, 2048):
        cache = StaticCache(config=cfg, max_batch_size=B, max_cache_len=512, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, 49152, (B, 1), device="cuda")
        with torch.inference_mode():
            cp = torch.tensor([300], device="cuda")
            out = m(ids, past_key_values=cache, cache_position=cp, use_cache=True); torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10): m(ids, past_key_values=cache, cache_position=cp, use_cache=True)
            torch.cuda.synchronize(); ms = (time.perf_counter()-t0)/10*1e3
        print(f"force_gqa={force} B={B}: {ms:.2f} ms/step eager -> {B/ms*1e3:,.0f} tok/s (forward only)", flush=True)
