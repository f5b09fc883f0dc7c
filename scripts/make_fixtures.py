#!/usr/bin/env python3
"""Generate the golden test fixtures of tiermoe (tests/fixtures/).

Run on a CUDA machine with torch, transformers 5.x, tokenizers, safetensors:

    python3 scripts/make_fixtures.py --out tests/fixtures

It writes
  OUT/models/<name>/      tiny random MoE checkpoints (save_pretrained) plus
                          reference.safetensors / reference.json computed in FP32 on CUDA
  OUT/tokenizers/<name>/  tokenizer.json (+ tokenizer_config.json) trained with the
                          `tokenizers` library, plus cases.json (encode/decode goldens)

Everything is seeded; see tests/fixtures/README.md for the file formats.

Besides the transformers reference, each model is re-run through an independent float64
re-implementation (`ref_forward` below, which reads only the saved safetensors and
config.json) to check that the architecture semantics written in reference.json are the
ones transformers actually executes.
"""

import argparse
import dataclasses
import glob
import inspect
import json
import math
import os
import shutil
import struct
import sys
import traceback

T_PROMPT = 24
N_GREEDY = 16
MIN_MARGIN = 1e-3
N_ID_SEEDS = 10
MIN_ROUTER_GAP = 2e-4  # preferred smallest k-th vs (k+1)-th router-logit gap
# After the perturbation the embedding is scaled up and q/k projections are sharpened: without
# this the tiny random models were dominated by near-uniform attention (a context average) and
# collapsed to one argmax token at every position.
EMBED_SCALE = 5.0  # default; a variant may list candidates in "embed_scales" (searched, see pick_embed_scale)
QK_SCALE = 2.0  # applied to q_proj/k_proj weights+biases and to q_norm/k_norm weights

ERRORS = []


def log(*a):
    print(*a, flush=True)


# ----------------------------------------------------------------------------------------
# Model variants
# ----------------------------------------------------------------------------------------

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    hidden_act="silu",
    initializer_range=0.08,
    use_cache=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=None,
    attention_dropout=0.0,
)

VARIANTS = [
    dict(
        name="mixtral_oldcfg",
        model_cls="MixtralForCausalLM",
        cfg_cls="MixtralConfig",
        arch="mixtral",
        dtype="bfloat16",
        seed=1001,
        theta=10000.0,
        shard="150KB",
        old_format=True,
        cfg=dict(
            head_dim=16,
            intermediate_size=32,
            num_hidden_layers=3,
            num_local_experts=8,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            sliding_window=None,
            router_jitter_noise=0.0,
            output_router_logits=False,
        ),
        description=(
            "MixtralForCausalLM, 3 layers, hidden 64, 4 query heads / 2 KV heads (GQA), head_dim 16, "
            "8 experts top-2 (expert FFN width 32 = intermediate_size), untied lm_head, bf16 weights, "
            "rms_norm_eps 1e-5, RoPE theta 10000. Saved sharded (model.safetensors.index.json). "
            "config.json was rewritten after saving into the OLD (transformers 4.x) format: top-level "
            "'rope_theta' and 'torch_dtype' instead of 'rope_parameters' and 'dtype'."
        ),
        features=[
            "sharded checkpoint + index json",
            "old-format config: top-level rope_theta, torch_dtype",
            "rope_theta differs from MixtralConfig's default (1e6)",
            "bf16 weights",
            "GQA 4q/2kv",
            "top-2 of 8 with renormalisation (Mixtral always renormalises)",
        ],
    ),
    dict(
        name="qwen2_moe",
        model_cls="Qwen2MoeForCausalLM",
        cfg_cls="Qwen2MoeConfig",
        arch="qwen2_moe",
        dtype="float16",
        seed=2002,
        theta=1000000.0,
        cfg=dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_hidden_layers=4,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            qkv_bias=True,
            use_sliding_window=False,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            output_router_logits=False,
        ),
        description=(
            "Qwen2MoeForCausalLM, 4 layers, hidden 64, 4q/2kv heads, head_dim 16, q/k/v projections with "
            "bias, fp16 weights. decoder_sparse_step=2 and mlp_only_layers=[]: layers whose "
            "(index+1) % 2 == 0 (i.e. 1 and 3) are sparse MoE, layers 0 and 2 are dense SwiGLU MLPs of "
            "intermediate_size 96. Sparse layers: 8 experts top-2 of width 32 (moe_intermediate_size), "
            "norm_topk_prob=False (no renormalisation), plus a shared expert of width 48 gated by "
            "sigmoid(shared_expert_gate(x)). RoPE theta 1e6, untied."
        ),
        features=[
            "qkv bias",
            "fp16 weights",
            "mixed dense/sparse layers via decoder_sparse_step=2",
            "shared expert with sigmoid gate",
            "no top-k renormalisation",
        ],
    ),
    dict(
        name="qwen3_moe",
        model_cls="Qwen3MoeForCausalLM",
        cfg_cls="Qwen3MoeConfig",
        arch="qwen3_moe",
        dtype="float32",
        seed=3003,
        theta=1000000.0,
        extra_cfg=dict(head_dim=16),
        embed_scales=[1.5, 2.0, 1.0, 3.0],
        cfg=dict(
            intermediate_size=96,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            attention_bias=False,
            use_sliding_window=False,
            output_router_logits=False,
        ),
        description=(
            "Qwen3MoeForCausalLM, 3 layers, hidden 64, 4q/2kv heads, head_dim 16, per-head q_norm/k_norm "
            "(RMSNorm over head_dim, before RoPE), fp32 weights. mlp_only_layers=[1]: layer 1 is a dense "
            "SwiGLU MLP of intermediate_size 96, layers 0 and 2 are sparse: 64 experts top-8 of width 32, "
            "norm_topk_prob=True (top-k probabilities renormalised to sum 1). tie_word_embeddings=True "
            "(no lm_head.weight in the checkpoint; logits use embed_tokens). New-format config "
            "(rope_parameters), RoPE theta 1e6. config.json carries an explicit head_dim (16) like real "
            "Qwen3-MoE configs, and transformers 5.17 writes the expert count as 'num_local_experts'."
        ),
        features=[
            "fp32 weights",
            "tied embeddings",
            "mlp_only_layers",
            "64 experts top-8 with renormalisation",
            "per-head q/k RMSNorm",
            "new-format config (rope_parameters, dtype)",
        ],
    ),
    dict(
        name="olmoe",
        model_cls="OlmoeForCausalLM",
        cfg_cls="OlmoeConfig",
        arch="olmoe",
        dtype="bfloat16",
        seed=4004,
        theta=10000.0,
        cfg=dict(
            intermediate_size=32,
            num_hidden_layers=2,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            clip_qkv=None,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            attention_bias=False,
            output_router_logits=False,
        ),
        description=(
            "OlmoeForCausalLM, 2 layers, hidden 64, 4q/2kv heads, head_dim 16, bf16 weights. q_norm / "
            "k_norm are RMSNorms over the WHOLE q projection (64) and k projection (32), applied before "
            "splitting into heads and before RoPE; clip_qkv null. 16 experts top-4 of width 32 "
            "(intermediate_size), norm_topk_prob=False. RoPE theta 10000, untied."
        ),
        features=[
            "q/k RMSNorm over the full projection",
            "16 experts top-4 without renormalisation",
            "bf16 weights",
            "clip_qkv null",
        ],
    ),
    dict(
        name="qwen3_moe_e256",
        model_cls="Qwen3MoeForCausalLM",
        cfg_cls="Qwen3MoeConfig",
        arch="qwen3_moe",
        dtype="bfloat16",
        seed=5005,
        theta=500000.0,
        extra_cfg=dict(head_dim=16),
        cfg=dict(
            hidden_size=48,
            intermediate_size=96,
            moe_intermediate_size=8,
            num_hidden_layers=2,
            num_experts=256,
            num_experts_per_tok=8,
            norm_topk_prob=False,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            attention_bias=False,
            use_sliding_window=False,
            output_router_logits=False,
        ),
        description=(
            "Qwen3MoeForCausalLM, 2 layers, both sparse: 256 experts top-8 of width 8 "
            "(moe_intermediate_size), norm_topk_prob=False, bf16 weights, per-head q/k RMSNorm, "
            "hidden_size 48 but 4q/2kv heads of head_dim 16 (explicit 'head_dim' in config.json), so "
            "q_proj is [64, 48], k/v_proj [32, 48] and o_proj [48, 64]: num_heads*head_dim != hidden_size "
            "as in Qwen3-30B-A3B (hidden 2048, 32 x 128). RoPE theta 5e5, untied. Exercises many experts "
            "(router over 256) and a tiny expert width."
        ),
        features=[
            "256 experts top-8",
            "moe_intermediate_size 8",
            "no renormalisation",
            "bf16 weights",
            "num_heads*head_dim (64) != hidden_size (48), explicit head_dim",
        ],
    ),
]


def config_field_names(cls):
    names = set()
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    try:
        for p in inspect.signature(cls.__init__).parameters.values():
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self":
                names.add(p.name)
    except (TypeError, ValueError):
        pass
    return names


def get_theta(cfg):
    rp = getattr(cfg, "rope_parameters", None)
    if isinstance(rp, dict) and rp.get("rope_theta") is not None:
        return float(rp["rope_theta"])
    t = getattr(cfg, "rope_theta", None)
    return None if t is None else float(t)


def theta_from_json(cj):
    rp = cj.get("rope_parameters")
    if isinstance(rp, dict) and rp.get("rope_theta") is not None:
        return float(rp["rope_theta"])
    if cj.get("rope_theta") is not None:
        return float(cj["rope_theta"])
    return None


def st_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return h


def perturb(model, seed, init_range, embed_scale):
    import torch

    g = torch.Generator().manual_seed(seed)
    notes = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            d = p.data
            rnd = torch.randn(d.shape, generator=g, dtype=torch.float32)
            if d.ndim == 1 and name.endswith("bias"):
                d.copy_(0.1 * rnd)
            elif d.ndim == 1:  # RMSNorm weights
                d.copy_(1.0 + 0.1 * rnd)
            else:
                f = d.float()
                bad = (not torch.isfinite(f).all()) or f.abs().max() > 10 or f.std() == 0
                if bad:
                    notes.append(name)
                    f = init_range * torch.randn(d.shape, generator=g, dtype=torch.float32)
                f = f + 0.5 * f.std() * rnd
                d.copy_(f.to(d.dtype))
        for name, p in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                p.data.mul_(embed_scale)
            elif any(s_ in name for s_ in (".q_proj.", ".k_proj.", ".q_norm.", ".k_norm.")):
                p.data.mul_(QK_SCALE)
    return notes


# ----------------------------------------------------------------------------------------
# Independent float64 re-implementation (reads the saved files only)
# ----------------------------------------------------------------------------------------


def load_saved_state(d):
    from safetensors.torch import load_file

    sd = {}
    for f in sorted(glob.glob(os.path.join(d, "*.safetensors"))):
        if os.path.basename(f) == "reference.safetensors":
            continue
        sd.update(load_file(f))
    return sd


def ref_forward(sd, cj, arch, ids):
    """float64 forward of the whole sequence; returns (logits [T,V], router top-k gaps per sparse layer)."""
    import torch

    sd = {k: v.to(torch.float64) for k, v in sd.items()}
    H = cj["hidden_size"]
    nh = cj["num_attention_heads"]
    nkv = cj["num_key_value_heads"]
    hd = cj.get("head_dim") or H // nh
    eps = cj["rms_norm_eps"]
    theta = theta_from_json(cj)
    k_top = cj["num_experts_per_tok"]
    renorm = True if arch == "mixtral" else bool(cj.get("norm_topk_prob", False))
    L = cj["num_hidden_layers"]
    T = ids.shape[0]

    def rms(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def swiglu(x, G, U, D):
        return (torch.nn.functional.silu(x @ G.T) * (x @ U.T)) @ D.T

    inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(T, dtype=torch.float64)[:, None] * inv[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]

    def rope(x):  # [T, heads, hd]
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    def lin(x, p):
        y = x @ sd[p + ".weight"].T
        if p + ".bias" in sd:
            y = y + sd[p + ".bias"]
        return y

    gaps = {}
    x = sd["model.embed_tokens.weight"][ids]
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    for i in range(L):
        P = f"model.layers.{i}"
        h = rms(x, sd[P + ".input_layernorm.weight"])
        q, k, v = lin(h, P + ".self_attn.q_proj"), lin(h, P + ".self_attn.k_proj"), lin(h, P + ".self_attn.v_proj")
        qn, kn = P + ".self_attn.q_norm.weight", P + ".self_attn.k_norm.weight"
        if qn in sd and sd[qn].shape[0] == nh * hd and nh * hd != hd:  # olmoe: norm over whole projection
            q, k = rms(q, sd[qn]), rms(k, sd[kn])
        q, k, v = q.view(T, nh, hd), k.view(T, nkv, hd), v.view(T, nkv, hd)
        if qn in sd and sd[qn].shape[0] == hd:  # qwen3: per-head norm
            q, k = rms(q, sd[qn]), rms(k, sd[kn])
        q, k = rope(q), rope(k)
        rep = nh // nkv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd) + mask
        a = torch.softmax(s, -1)
        o = torch.einsum("hts,shd->thd", a, v).reshape(T, nh * hd)
        x = x + lin(o, P + ".self_attn.o_proj")

        h = rms(x, sd[P + ".post_attention_layernorm.weight"])
        mp = None
        for cand in ("mlp", "block_sparse_moe"):
            if any(key.startswith(f"{P}.{cand}.") for key in sd):
                mp = f"{P}.{cand}"
        if mp + ".gate.weight" not in sd:  # dense layer
            y = swiglu(h, sd[mp + ".gate_proj.weight"], sd[mp + ".up_proj.weight"], sd[mp + ".down_proj.weight"])
        else:
            Wr = sd[mp + ".gate.weight"]
            E = Wr.shape[0]
            if mp + ".experts.gate_up_proj" in sd:
                gu, dn = sd[mp + ".experts.gate_up_proj"], sd[mp + ".experts.down_proj"]
                if gu.shape[-1] != H:  # stored [E, H, 2I]
                    gu = gu.transpose(1, 2)
                if dn.shape[1] != H:  # stored [E, I, H]
                    dn = dn.transpose(1, 2)
                I = gu.shape[1] // 2
                G, U, D = gu[:, :I], gu[:, I:], dn
            elif mp + ".experts.0.w1.weight" in sd:
                G = torch.stack([sd[f"{mp}.experts.{e}.w1.weight"] for e in range(E)])
                U = torch.stack([sd[f"{mp}.experts.{e}.w3.weight"] for e in range(E)])
                D = torch.stack([sd[f"{mp}.experts.{e}.w2.weight"] for e in range(E)])
            else:
                G = torch.stack([sd[f"{mp}.experts.{e}.gate_proj.weight"] for e in range(E)])
                U = torch.stack([sd[f"{mp}.experts.{e}.up_proj.weight"] for e in range(E)])
                D = torch.stack([sd[f"{mp}.experts.{e}.down_proj.weight"] for e in range(E)])
            logits_r = h @ Wr.T
            srt = logits_r.sort(-1, descending=True).values
            gaps[i] = float((srt[:, k_top - 1] - srt[:, k_top]).min())
            probs = torch.softmax(logits_r, -1)
            tv, ti = probs.topk(k_top, -1)
            if renorm:
                tv = tv / tv.sum(-1, keepdim=True)
            y = torch.zeros_like(h)
            for t in range(T):
                for j in range(k_top):
                    e = int(ti[t, j])
                    y[t] += tv[t, j] * swiglu(h[t : t + 1], G[e], U[e], D[e])[0]
            if mp + ".shared_expert.gate_proj.weight" in sd:
                sh = swiglu(
                    h,
                    sd[mp + ".shared_expert.gate_proj.weight"],
                    sd[mp + ".shared_expert.up_proj.weight"],
                    sd[mp + ".shared_expert.down_proj.weight"],
                )
                y = y + torch.sigmoid(h @ sd[mp + ".shared_expert_gate.weight"].T) * sh
        x = x + y
    x = rms(x, sd["model.norm.weight"])
    W = sd["lm_head.weight"] if "lm_head.weight" in sd else sd["model.embed_tokens.weight"]
    return x @ W.T, gaps


# ----------------------------------------------------------------------------------------


def pick_embed_scale(build, scales, dt, V):
    """Quick diversity probe (in-memory model, fp32 on CUDA): mean number of distinct tokens in an
    8-step greedy continuation over 4 random prompts; the first scale with the best score wins."""
    import torch

    trials = {}
    for sc in scales:
        m, _ = build(sc)
        m = m.to(dt).float().cuda().eval()
        tot = 0
        with torch.no_grad():
            for s_ in range(4):
                g = torch.Generator().manual_seed(77 + s_)
                seq = torch.randint(0, V, (T_PROMPT,), generator=g).cuda()
                out = []
                for _ in range(8):
                    nxt = m(input_ids=seq[None], use_cache=False).logits[0, -1].argmax()
                    out.append(int(nxt))
                    seq = torch.cat([seq, nxt[None]])
                tot += len(set(out))
        trials[str(sc)] = tot / 4
        log(f"  embed scale {sc}: mean distinct greedy tokens {tot / 4}")
        del m
    best = max(scales, key=lambda sc: trials[str(sc)])
    return best, trials


def make_model(v, out_root):
    import torch
    import transformers
    from safetensors.torch import save_file

    name = v["name"]
    d = os.path.join(out_root, "models", name)
    if os.path.exists(d):
        shutil.rmtree(d)
    os.makedirs(d)
    log(f"\n===== {name} =====")
    info = {"name": name, "notes": []}

    cfg_cls = getattr(transformers, v["cfg_cls"])
    model_cls = getattr(transformers, v["model_cls"])
    fields = config_field_names(cfg_cls)
    kw = dict(COMMON)
    kw.update(v["cfg"])
    rope_key = None
    if "rope_parameters" in fields:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": v["theta"]}
        rope_key = "rope_parameters"
    else:
        kw["rope_theta"] = v["theta"]
        rope_key = "rope_theta"
    dropped = sorted(k for k in kw if k not in fields)
    for k in dropped:
        kw.pop(k)
    if dropped:
        info["notes"].append(f"config kwargs not accepted by {v['cfg_cls']} and dropped: {dropped}")
    extra = v.get("extra_cfg", {})
    if extra:
        kw.update(extra)
        info["notes"].append(
            f"passed as extra (non-field) config attributes, written to config.json: {sorted(extra)}"
        )
    log("dropped kwargs:", dropped, "| extra:", extra, "| rope via", rope_key)
    cfg = cfg_cls(**kw)
    assert get_theta(cfg) == v["theta"], (get_theta(cfg), v["theta"])

    def build(scale):
        torch.manual_seed(v["seed"])
        m = model_cls(cfg).float().eval()
        return m, perturb(m, v["seed"] + 1, COMMON["initializer_range"], scale)

    scales = v.get("embed_scales", [EMBED_SCALE])
    if len(scales) > 1:
        embed_scale, trials = pick_embed_scale(build, scales, getattr(torch, v["dtype"]), kw["vocab_size"])
        info["embed_scale_search"] = trials
    else:
        embed_scale = scales[0]
    info["embed_scale"] = embed_scale
    info["qk_scale"] = QK_SCALE
    model, bad = build(embed_scale)
    if bad:
        info["notes"].append(f"params that were not initialised (re-drawn before perturbing): {bad}")
    # check bias / structure facts
    attn0 = model.model.layers[0].self_attn
    if "head_dim" in kw:
        assert attn0.q_proj.weight.shape[0] == kw["num_attention_heads"] * kw["head_dim"], attn0.q_proj.weight.shape
    info["q_proj_has_bias"] = attn0.q_proj.bias is not None
    info["o_proj_has_bias"] = attn0.o_proj.bias is not None
    log("q_proj bias:", info["q_proj_has_bias"])
    if v["name"] == "qwen2_moe":
        assert info["q_proj_has_bias"], "Qwen2Moe should have qkv bias"

    dt = getattr(torch, v["dtype"])
    model = model.to(dt)
    try:
        model.config.dtype = dt
    except Exception as e:  # noqa
        info["notes"].append(f"could not set config.dtype: {e!r}")
    in_memory_sd = {k: t.detach().clone() for k, t in model.state_dict().items()}
    info["module_repr"] = str(model)
    log(model)

    save_kw = {}
    if v.get("shard"):
        save_kw["max_shard_size"] = v["shard"]
    sp_params = list(inspect.signature(model.save_pretrained).parameters)
    info["save_pretrained_params"] = sp_params
    model.save_pretrained(d, **save_kw)
    del model

    cfg_path = os.path.join(d, "config.json")
    with open(cfg_path) as f:
        cj_new = json.load(f)
    info["config_json_as_written_by_save_pretrained"] = cj_new
    cj = dict(cj_new)
    if v.get("old_format"):
        cj = {}
        for k2, val in cj_new.items():
            if k2 == "rope_parameters":
                cj["rope_theta"] = float(v["theta"])
                rs = {kk: vv for kk, vv in (val or {}).items() if kk not in ("rope_type", "rope_theta")}
                if rs:
                    info["notes"].append(f"dropped extra rope_parameters keys in old format: {rs}")
            elif k2 == "dtype":
                cj["torch_dtype"] = val
            else:
                cj[k2] = val
        if "rope_theta" not in cj:
            cj["rope_theta"] = float(v["theta"])
        if "torch_dtype" not in cj:
            cj["torch_dtype"] = v["dtype"]
        with open(cfg_path, "w") as f:
            json.dump(cj, f, indent=2, sort_keys=False)
            f.write("\n")
    info["config_keys"] = sorted(cj.keys())

    # tensor names as written
    files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(d, "*.safetensors")))
    tensors = {}
    for fn in files:
        for tn, meta in st_header(os.path.join(d, fn)).items():
            tensors[tn] = {"dtype": meta["dtype"], "shape": meta["shape"], "file": fn}
    info["files"] = sorted(os.listdir(d))
    info["tensor_names"] = sorted(tensors)
    info["tensors"] = {k: tensors[k] for k in sorted(tensors)}
    log("files:", info["files"])
    log(f"{len(tensors)} tensors; first few:", info["tensor_names"][:12])

    # ---- load back exactly like a user would, FP32, eager ----
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    from transformers import AutoConfig, AutoModelForCausalLM

    lcfg = AutoConfig.from_pretrained(d)
    info["loaded_config_theta"] = get_theta(lcfg)
    info["loaded_config_dtype"] = str(getattr(lcfg, "dtype", None))
    log("loaded config theta:", info["loaded_config_theta"], "dtype:", info["loaded_config_dtype"])
    load_kw = dict(dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    if info["loaded_config_theta"] != v["theta"]:
        msg = f"transformers read theta {info['loaded_config_theta']} from the rewritten config, expected {v['theta']}"
        ERRORS.append(f"{name}: {msg}")
        info["notes"].append(msg + "; reference computed with an explicitly corrected config")
        lcfg = cfg_cls(**{**kw})
        load_kw["config"] = lcfg
    model, linfo = AutoModelForCausalLM.from_pretrained(d, **load_kw)
    linfo = {k: sorted(map(str, val)) if isinstance(val, (list, set, tuple)) else str(val) for k, val in linfo.items()}
    info["loading_info"] = linfo
    log("loading info:", linfo)
    if linfo.get("missing_keys") or linfo.get("unexpected_keys") or linfo.get("mismatched_keys"):
        ERRORS.append(f"{name}: loading info not clean: {linfo}")
    try:
        model.set_experts_implementation("eager")
    except Exception as e:  # noqa
        info["notes"].append(f"set_experts_implementation('eager') failed: {e!r}")
    model = model.cuda().eval()
    info["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    info["experts_implementation"] = getattr(model.config, "_experts_implementation", None)
    log("attn impl:", info["attn_implementation"], "experts impl:", info["experts_implementation"])

    # weights round-trip
    lsd = model.state_dict()
    mism = []
    for k2, t in lsd.items():
        if k2 not in in_memory_sd:
            mism.append(f"{k2}: not in the in-memory model")
            continue
        if not torch.equal(t.detach().cpu().float(), in_memory_sd[k2].float()):
            mism.append(k2)
    info["roundtrip_weight_mismatches"] = mism
    if mism:
        ERRORS.append(f"{name}: weights differ after save/load: {mism[:8]}")
    log("roundtrip mismatches:", mism[:8])

    # rotary check
    try:
        inv = model.model.rotary_emb.inv_freq.detach().cpu().double()
        hd = cj.get("head_dim") or cj["hidden_size"] // cj["num_attention_heads"]
        exp = 1.0 / (v["theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        ok = bool(torch.allclose(inv, exp, rtol=1e-5))
        info["rotary_inv_freq_matches_theta"] = ok
        log("inv_freq matches theta", v["theta"], ":", ok)
        if not ok:
            ERRORS.append(f"{name}: rotary inv_freq does not match theta {v['theta']}")
    except Exception as e:  # noqa
        info["notes"].append(f"rotary check failed: {e!r}")

    V = cj["vocab_size"]

    @torch.no_grad()
    def fwd(seq):
        return model(input_ids=seq[None].cuda(), use_cache=False).logits[0].float().cpu()

    saved_sd = load_saved_state(d)
    best = None
    for attempt in range(N_ID_SEEDS):
        ids_seed = v["seed"] * 100 + attempt
        g = torch.Generator().manual_seed(ids_seed)
        ids = torch.randint(0, V, (T_PROMPT,), generator=g, dtype=torch.int64)
        logits = fwd(ids)
        seq = ids.clone()
        greedy, margins = [], []
        for _ in range(N_GREEDY):
            last = fwd(seq)[-1]
            top = last.topk(2)
            margins.append(float(top.values[0] - top.values[1]))
            nxt = int(last.argmax())
            greedy.append(nxt)
            seq = torch.cat([seq, torch.tensor([nxt], dtype=torch.int64)])
        mmin = min(margins)
        cand = dict(ids_seed=ids_seed, ids=ids, logits=logits, greedy=greedy, margin=mmin, seq=seq)
        cand["greedy_distinct"] = len(set(greedy))
        cand["prompt_argmax_distinct"] = len(set(logits.argmax(-1).tolist()))
        # independent re-implementation on the full sequence (prompt + greedy[:-1])
        try:
            full = seq[:-1]
            rl, gaps = ref_forward(saved_sd, cj, v["arch"], full)
            hf_full = fwd(full)
            cand["reimpl_max_abs_diff_prompt"] = float((rl[:T_PROMPT] - logits.double()).abs().max())
            cand["reimpl_max_abs_diff_full"] = float((rl - hf_full.double()).abs().max())
            cand["reimpl_greedy_agrees"] = rl[T_PROMPT - 1 :].argmax(-1).tolist() == greedy
            cand["router_gap_min"] = min(gaps.values()) if gaps else None
            cand["router_gap_by_layer"] = gaps
        except Exception as e:  # noqa
            cand["reimpl_error"] = "".join(traceback.format_exception(e))[-2000:]
            cand["router_gap_min"] = None
        log(
            f"  ids_seed {ids_seed}: margin_min {mmin:.4g}, router_gap_min {cand.get('router_gap_min')}, "
            f"distinct argmax prompt/greedy {cand['prompt_argmax_distinct']}/{cand['greedy_distinct']}, "
            f"reimpl diff {cand.get('reimpl_max_abs_diff_full')}, greedy agrees {cand.get('reimpl_greedy_agrees')}"
            + (f"\n{cand['reimpl_error']}" if "reimpl_error" in cand else "")
        )
        if mmin < MIN_MARGIN:
            continue

        def score(c):
            gap = c["router_gap_min"] if c.get("router_gap_min") is not None else 0.0
            return (gap >= MIN_ROUTER_GAP, min(c["greedy_distinct"], 8), gap)

        if best is None or score(cand) > score(best):
            best = cand
    if best is None:
        raise RuntimeError(f"{name}: no ids seed gave greedy margin >= {MIN_MARGIN}")

    ref = {
        "ids": best["ids"].contiguous(),
        "logits": best["logits"].contiguous(),
        "greedy_ids": torch.tensor(best["greedy"], dtype=torch.int64),
        "greedy_margin_min": torch.tensor([best["margin"]], dtype=torch.float32),
    }
    save_file(ref, os.path.join(d, "reference.safetensors"), metadata={"fixture": name, "transformers": transformers.__version__})

    info.update(
        architecture=v["model_cls"],
        description=v["description"],
        features=v["features"],
        save_dtype=v["dtype"],
        rope_theta=v["theta"],
        seeds={"model_init": v["seed"], "perturb": v["seed"] + 1, "ids": best["ids_seed"]},
        ids=best["ids"].tolist(),
        greedy_ids=best["greedy"],
        greedy_margin_min=best["margin"],
        greedy_distinct_tokens=best["greedy_distinct"],
        prompt_argmax_distinct_tokens=best["prompt_argmax_distinct"],
        router_topk_logit_gap_min=best.get("router_gap_min"),
        router_topk_logit_gap_by_layer={str(k2): val for k2, val in (best.get("router_gap_by_layer") or {}).items()},
        reimpl_float64_max_abs_diff_vs_reference=best.get("reimpl_max_abs_diff_full"),
        reimpl_float64_greedy_agrees=best.get("reimpl_greedy_agrees"),
        reimpl_error=best.get("reimpl_error"),
        logits_abs_max=float(best["logits"].abs().max()),
        logits_std=float(best["logits"].std()),
        computed=(
            "Random init (seeded, initializer_range 0.08) in fp32, every parameter perturbed (2-D: += "
            "0.5*std*randn; norm weights: 1+0.1*randn; biases: 0.1*randn), then embed_tokens scaled by "
            f"embed_scale={embed_scale} and q_proj/k_proj (weight and bias) and q_norm/k_norm weights by "
            f"{QK_SCALE} so that logits depend on the token and attention is not near-uniform; cast to the "
            "save dtype and saved with save_pretrained. "
            f"The prompt seed was chosen among {N_ID_SEEDS} (greedy margin >= {MIN_MARGIN}, router gap >= "
            f"{MIN_ROUTER_GAP} preferred, then most distinct greedy tokens). "
            "Reference: the saved checkpoint loaded back with AutoModelForCausalLM.from_pretrained(dtype="
            "float32, attn_implementation='eager'), experts implementation 'eager', on CUDA with TF32 off. "
            "logits = model(ids).logits[0] (all positions). greedy_ids: manual loop of 16 steps, each a full "
            "forward (use_cache=False) over prompt+generated, argmax of the last position; "
            "greedy_margin_min = min over the 16 steps of top1-top2 logit. router_topk_logit_gap_min = "
            "smallest gap between the k-th and (k+1)-th router logit over all tokens of prompt+greedy "
            "and all sparse layers (a tie there would make expert selection fragile). The float64 "
            "re-implementation (scripts/make_fixtures.py:ref_forward) reads only the saved files."
        ),
        versions={
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "cuda_device": torch.cuda.get_device_name(0),
        },
    )
    keys_first = [
        "name", "architecture", "description", "features", "save_dtype", "rope_theta", "seeds", "ids",
        "greedy_ids", "greedy_margin_min", "greedy_distinct_tokens", "prompt_argmax_distinct_tokens",
        "router_topk_logit_gap_min", "router_topk_logit_gap_by_layer",
        "reimpl_float64_max_abs_diff_vs_reference", "reimpl_float64_greedy_agrees", "logits_abs_max",
        "logits_std", "computed", "versions", "files", "config_keys", "q_proj_has_bias", "o_proj_has_bias",
        "loaded_config_theta", "loaded_config_dtype", "rotary_inv_freq_matches_theta", "attn_implementation",
        "experts_implementation", "loading_info", "roundtrip_weight_mismatches", "notes",
    ]
    ordered = {k2: info[k2] for k2 in keys_first if k2 in info}
    for k2 in info:
        if k2 not in ordered:
            ordered[k2] = info[k2]
    with open(os.path.join(d, "reference.json"), "w") as f:
        json.dump(ordered, f, indent=1, ensure_ascii=False)
        f.write("\n")
    if best.get("reimpl_greedy_agrees") is False:
        ERRORS.append(f"{name}: float64 re-implementation greedy disagrees")
    del model
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------
# Tokenizers
# ----------------------------------------------------------------------------------------

PARAGRAPH = (
    "Le café naïve à Zürich — São Paulo, España, Kraków, Ångström, façade, résumé, über. "
    "東京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다. "
    "Ελληνικά και русский язык. Emoji: 🙂 🚀 ✨ — “quotes” and ‘single’ … done.\n"
)

QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CASES = [
    "",
    " ",
    "   ",
    "a",
    "\n",
    "Hello world",
    "  leading spaces",
    "trailing spaces   ",
    "multiple    spaces   between  words",
    "\ttab\tseparated\tvalues\t",
    "line one\nline two\n\nline four\n",
    "windows\r\nline\r\nendings\r\n",
    "def forward(self, x):\n    return self.proj(x) + 1\n",
    "for i in range(10):\n\tprint(f\"{i:03d}\")  # comment",
    "import numpy as np\nx = np.zeros((3, 4), dtype=np.float32)",
    "12345",
    "3.14 and 2.71828, 1,000,000 and 007",
    "Version 1.2.3 on port 8080 at 12:45",
    "café naïve résumé façade",
    "Ünïcödé Ñandú São Paulo Kraków",
    "e\u0301 vs \u00e9 (decomposed vs composed)",
    "日本語のテキストです。",
    "中文测试：你好，世界！",
    "한국어 텍스트",
    "Ελληνικά и русский текст",
    "emoji 😀🎉👍🏽 and flags 🇫🇷",
    "mixed: naïve 日本 😀 ok",
    "<s>Hello</s> world",
    "<unk> token in text",
    "<|endoftext|>",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "xyzzyplugh quuxfrobnicate zorblax",
    "supercalifragilisticexpialidocious",
    "He said: \"it's fine\", didn't he? We'll see; they're here, I'M SURE YOU'RE RIGHT.",
    "https://example.com/path?q=1&r=2#frag",
    "!!!???...,,,;;;---___",
    "▁already contains ▁ metaspace",
    "bell\x07 and nul\x00 control\x7f chars",
]


def collect_corpus(max_chars=300_000):
    import tokenizers
    import transformers

    base = os.path.dirname(transformers.__file__)
    files = []
    for sub in ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3_moe", "olmoe", "gpt2"):
        files += sorted(glob.glob(os.path.join(base, "models", sub, "*.py")))
    files += sorted(glob.glob(os.path.join(os.path.dirname(tokenizers.__file__), "**", "*.py"), recursive=True))
    texts, used, total = [], [], 0
    for f in files:
        with open(f, encoding="utf-8", errors="replace") as fh:
            t = fh.read()
        if total + len(t) > max_chars:
            t = t[: max_chars - total]
        texts.append(t)
        used.append(os.path.relpath(f, os.path.dirname(base)))
        total += len(t)
        if total >= max_chars:
            break
    texts += [PARAGRAPH] * 5
    return texts, used


def train_sp_like(texts, vocab_total, normalizer, train_pre):
    """BPE trained on lines, then re-numbered as <unk>,<s>,</s>,<0x00>..<0xFF>,learned..."""
    from tokenizers import Tokenizer, models, trainers

    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    if normalizer is not None:
        t.normalizer = normalizer
    t.pre_tokenizer = train_pre
    specials = ["<unk>", "<s>", "</s>"]
    tr = trainers.BpeTrainer(
        vocab_size=vocab_total - 256, min_frequency=2, special_tokens=specials, show_progress=False
    )
    lines = [ln for txt in texts for ln in txt.splitlines() if ln.strip()]
    t.train_from_iterator(lines, trainer=tr)
    dj = json.loads(t.to_str())
    vocab = dj["model"]["vocab"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in dj["model"]["merges"]]
    new = {s: i for i, s in enumerate(specials)}
    for b in range(256):
        new[f"<0x{b:02X}>"] = len(new)
    for tok_, _ in sorted(vocab.items(), key=lambda kv: kv[1]):
        if tok_ not in new:
            new[tok_] = len(new)
    return new, merges


def make_tokenizers(out_root):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    texts, used = collect_corpus()
    log(f"\n===== tokenizers: corpus {sum(map(len, texts))} chars from {len(used)} files =====")
    results = {}

    def finish(name, tok, cfg, patch=None):
        d = os.path.join(out_root, "tokenizers", name)
        if os.path.exists(d):
            shutil.rmtree(d)
        os.makedirs(d)
        dj = json.loads(tok.to_str())
        if patch:
            patch(dj)
        tok = Tokenizer.from_str(json.dumps(dj))
        tok.save(os.path.join(d, "tokenizer.json"), pretty=True)
        if cfg is not None:
            with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
                json.dump(cfg, f, indent=2, ensure_ascii=False)
                f.write("\n")
        tok = Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
        cases = []
        for text in CASES:
            ids = tok.encode(text, add_special_tokens=False).ids
            ids_s = tok.encode(text, add_special_tokens=True).ids
            cases.append({"text": text, "ids": ids, "ids_with_special": ids_s, "decoded": tok.decode(ids, skip_special_tokens=False)})
        with open(os.path.join(d, "cases.json"), "w") as f:
            json.dump({"cases": cases}, f, indent=1, ensure_ascii=False)
            f.write("\n")
        nbf = sum(1 for c in cases for i in c["ids"] if tok.id_to_token(i).startswith("<0x"))
        log(f"{name}: vocab {tok.get_vocab_size(with_added_tokens=True)}, {len(cases)} cases, byte-fallback ids used: {nbf}")
        for c in cases[:8] + cases[-12:]:
            log("  ", repr(c["text"])[:60], c["ids"][:16], "->", repr(c["decoded"])[:60])
        # cross-check with transformers' fast tokenizer wrapper (informational)
        try:
            from transformers import AutoTokenizer

            hf = AutoTokenizer.from_pretrained(d)
            bad = [c["text"] for c in cases if hf(c["text"], add_special_tokens=True)["input_ids"] != c["ids_with_special"]]
            log(f"  transformers AutoTokenizer ({type(hf).__name__}) disagreements: {len(bad)} {bad[:5]}")
        except Exception as e:  # noqa
            log(f"  transformers AutoTokenizer check failed: {e!r}")
        results[name] = {"vocab": tok.get_vocab_size(with_added_tokens=True), "byte_fallback_ids": nbf}

    # 1. llama_style
    sp_norm = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    vocab, merges = train_sp_like(
        texts, 800, sp_norm, pre_tokenizers.Split("▁", behavior="merged_with_next")
    )
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )

    def patch_llama(dj):
        dj["pre_tokenizer"] = None
        dj["model"]["dropout"] = None

    llama_cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "clean_up_tokenization_spaces": False,
        "legacy": True,
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    finish("llama_style", tok, llama_cfg, patch_llama)

    # 2. metaspace_style
    vocab, merges = train_sp_like(
        texts, 700, None, pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    )
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )

    def patch_meta(dj):
        dj["normalizer"] = None

    finish("metaspace_style", tok, dict(llama_cfg, legacy=False), patch_meta)

    # 3. qwen_style
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tr = trainers.BpeTrainer(
        vocab_size=997,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts, trainer=tr)
    tok.add_special_tokens(
        [AddedToken(s, special=True, normalized=False) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")]
    )

    def patch_qwen(dj):
        bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
        dj["pre_tokenizer"]["pretokenizers"][1] = dict(bl)
        dj["post_processor"] = dict(bl)
        dj["decoder"] = dict(bl)
        dj["model"]["dropout"] = None
        dj["model"]["continuing_subword_prefix"] = ""
        dj["model"]["end_of_word_suffix"] = ""

    qwen_cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 256,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": (
            "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] "
            "+ '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
        ),
    }
    finish("qwen_style", tok, qwen_cfg, patch_qwen)

    with open(os.path.join(out_root, "tokenizers", "corpus_files.txt"), "w") as f:
        f.write("# training corpus of all tokenizer fixtures (first 300000 chars of these files, in order,\n")
        f.write("# then a non-ASCII paragraph x5, see PARAGRAPH in scripts/make_fixtures.py)\n")
        f.write("\n".join(used) + "\n")
    return results


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (e.g. tests/fixtures)")
    ap.add_argument("--only", default="", help="comma-separated subset of model fixture names / 'tokenizers'")
    args = ap.parse_args()

    import torch
    import transformers
    import tokenizers

    log("python", sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
        "tokenizers", tokenizers.__version__)
    if not torch.cuda.is_available():
        sys.exit("a CUDA device is required")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    only = {s for s in args.only.split(",") if s}
    os.makedirs(args.out, exist_ok=True)
    for v in VARIANTS:
        if only and v["name"] not in only:
            continue
        try:
            make_model(v, args.out)
        except Exception as e:  # noqa
            ERRORS.append(f"{v['name']}: {e!r}")
            traceback.print_exc()
    if not only or "tokenizers" in only:
        try:
            make_tokenizers(args.out)
        except Exception as e:  # noqa
            ERRORS.append(f"tokenizers: {e!r}")
            traceback.print_exc()
    log("\nERRORS:" if ERRORS else "\nall fixtures written, no errors")
    for e in ERRORS:
        log("  ", e)
    sys.exit(1 if ERRORS else 0)


if __name__ == "__main__":
    main()
