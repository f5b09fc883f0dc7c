#!/usr/bin/env python3
"""The client side of tests/client/gpu_serve.sh, for a GPU machine without Node: smoke checks of
the OpenAI protocol, greedy comparisons, and a transcription of scripts/loadgen.mjs (same
prompts, request body and metric definitions). Standard library only.

  gpu_client.py smoke URL | ids URL 1,2,3 N CONCURRENT | mixed URL 1,2,3 N | loadgen URL 1,8,32 |
                agent URL FILE TURNS | long URL FILE CHARS"""
import http.client, itertools, json, os, sys, threading, time, urllib.parse

def conn(url):
    u = urllib.parse.urlparse(url)
    return http.client.HTTPConnection(u.hostname, u.port, timeout=600)

def req(url, method, path, body=None):
    c = conn(url)
    c.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read().decode()
    c.close()
    return r.status, data

def stream(url, path, body):
    """Returns (status, events as parsed JSON or '[DONE]', arrival times of text chunks)."""
    c = conn(url)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse()
    if r.status != 200:
        return r.status, [r.read().decode()], []
    buf, events, times = b"", [], []
    while True:
        chunk = r.read1(65536) if hasattr(r, "read1") else r.read(1)
        if not chunk:
            break
        buf += chunk
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            ev = ev.decode()
            if not ev.startswith("data: "):
                continue
            data = ev[6:]
            if data == "[DONE]":
                events.append("[DONE]")
                continue
            j = json.loads(data)
            events.append(j)
            ch = j.get("choices") or [{}]
            if ch[0].get("text") or (ch[0].get("delta") or {}).get("content"):
                times.append(time.perf_counter())
    c.close()
    return 200, events, times

def streamed_text(events, chat=False):
    out, finishes = "", 0
    for e in events:
        if e == "[DONE]" or not e.get("choices"):
            continue
        c = e["choices"][0]
        out += (c.get("delta") or {}).get("content") or "" if chat else c.get("text") or ""
        finishes += c.get("finish_reason") is not None
    assert events and events[-1] == "[DONE]", "no [DONE]"
    assert finishes == 1, f"{finishes} finish chunks"
    return out

def greedy_ids(url, ids, n, concurrent):
    """Greedy completion of a token-id prompt: alone, streamed, and `concurrent` at once."""
    body = {"prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": True}
    st, data = req(url, "POST", "/v1/completions", body)
    assert st == 200, data
    j = json.loads(data)
    alone = j["choices"][0]["text"]
    st, ev, _ = stream(url, "/v1/completions", dict(body, stream=True))
    s = streamed_text(ev)
    texts = [None] * concurrent
    def one(i):
        texts[i] = json.loads(req(url, "POST", "/v1/completions", body)[1])["choices"][0]["text"]
    th = [threading.Thread(target=one, args=(i,)) for i in range(concurrent)]
    [t.start() for t in th]
    [t.join() for t in th]
    return {"alone": alone, "usage": j["usage"], "streamed_equal": s == alone,
            "concurrent_equal": sum(t == alone for t in texts), "concurrent": concurrent}

def mixed(url, ids, n):
    """n greedy requests of different lengths (prefixes of `ids`, 4..40 new tokens) sent at once
    with staggered starts, each compared with the same request alone: batched decode, requests
    joining and leaving, and lone decode steps (CUDA graphs) on caches that come and go."""
    reqs = [{"prompt": ids[: 4 + i % (len(ids) - 3)], "max_tokens": 4 + (i * 7) % 37, "temperature": 0, "ignore_eos": True}
            for i in range(n)]
    text = lambda b: json.loads(req(url, "POST", "/v1/completions", b)[1])["choices"][0]["text"]
    together = [None] * n
    def one(i):
        time.sleep(0.002 * (i % 8))
        together[i] = text(reqs[i])
    th = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    [t.start() for t in th]
    [t.join() for t in th]
    alone = [text(r) for r in reqs]
    return {"requests": n, "equal_to_alone": sum(a == b for a, b in zip(alone, together)),
            "differ": [i for i in range(n) if alone[i] != together[i]]}

def smoke(url):
    out = {}
    out["health"] = req(url, "GET", "/health")
    out["models"] = json.loads(req(url, "GET", "/v1/models")[1])
    st, data = req(url, "POST", "/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0})
    out["completion"] = {"status": st, "body": json.loads(data)}
    st, ev, _ = stream(url, "/v1/completions", {"prompt": "def fibonacci(n):", "max_tokens": 12, "temperature": 0,
                                                "stream": True, "stream_options": {"include_usage": True}})
    out["completion_stream"] = {"events": len(ev), "text": streamed_text(ev),
                                "equal_to_non_streamed": streamed_text(ev) == out["completion"]["body"]["choices"][0]["text"],
                                "usage": [e for e in ev if e != "[DONE]" and e.get("usage")][-1]["usage"]}
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A function that adds two numbers."}]
    st, data = req(url, "POST", "/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "temperature": 0})
    out["chat"] = {"status": st, "body": json.loads(data)}
    st, ev, _ = stream(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 12, "temperature": 0, "stream": True})
    out["chat_stream"] = {"events": len(ev), "first_delta": ev[0]["choices"][0]["delta"], "text": streamed_text(ev, chat=True)}
    out["chat_stream"]["equal_to_non_streamed"] = out["chat_stream"]["text"] == out["chat"]["body"]["choices"][0]["message"]["content"]
    st, data = req(url, "POST", "/v1/completions", {"prompt": "x", "max_tokens": -1})
    out["bad_max_tokens"] = {"status": st, "body": json.loads(data)}
    return out

# ---- loadgen: scripts/loadgen.mjs, transcribed ----
def lg_prompt(i, prompt_tokens):
    s = f"# request {i}\n"
    k = 0
    while len(s) < prompt_tokens * 3.5:
        s += f"def f_{i}_{k}(x):\n    return x * {k} + {i}\n"
        k += 1
    return s

def pct(xs, p):
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]

# Every request's prompt its own (a run-wide counter), so a prefix cache finds nothing to reuse.
_lg_sent = itertools.count()

def lg_one(url, model, prompt_tokens, max_tokens):
    i = next(_lg_sent)
    t0 = time.perf_counter()
    st, ev, times = stream(url, "/v1/completions", {"model": model, "prompt": lg_prompt(i, prompt_tokens),
        "max_tokens": max_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
        "stream_options": {"include_usage": True}})
    if st != 200:
        raise RuntimeError(f"HTTP {st}: {ev}")
    usage = [e for e in ev if e != "[DONE]" and e.get("usage")]
    if not ev or ev[-1] != "[DONE]" or not usage:
        raise RuntimeError("incomplete stream")
    n = usage[-1]["usage"]["completion_tokens"]
    ms = lambda a, b: (b - a) * 1000
    gaps = [ms(a, b) for a, b in zip(times, times[1:])]
    return {"ttft": ms(t0, times[0]), "gaps": gaps, "tokens": n, "prompt_tokens": usage[-1]["usage"]["prompt_tokens"],
            "tpot": ms(times[0], times[-1]) / (n - 1) if n > 1 else float("nan")}

def lg_level(url, model, c, prompt_tokens, max_tokens, per_level=0):
    total = per_level or max(8, 4 * c)
    lock, nxt, results = threading.Lock(), [0], []
    def worker():
        while True:
            with lock:
                if nxt[0] >= total:
                    return
                nxt[0] += 1
            r = lg_one(url, model, prompt_tokens, max_tokens)
            with lock:
                results.append(r)
    t0 = time.perf_counter()
    th = [threading.Thread(target=worker) for _ in range(c)]
    [t.start() for t in th]
    [t.join() for t in th]
    secs = time.perf_counter() - t0
    gaps = [g for r in results for g in r["gaps"]]
    f = lambda x: round(x, 1)
    q = lambda xs: {"p50": f(pct(xs, 50)), "p90": f(pct(xs, 90)), "p99": f(pct(xs, 99))}
    return {"concurrency": c, "requests": len(results), "seconds": f(secs),
            "prompt_tokens": round(sum(r["prompt_tokens"] for r in results) / len(results)), "output_tokens": max_tokens,
            "req_per_s": round(len(results) / secs, 2), "output_tok_per_s": f(sum(r["tokens"] for r in results) / secs),
            "ttft_ms": q([r["ttft"] for r in results]), "itl_ms": q(gaps), "tpot_ms_p50": f(pct([r["tpot"] for r in results], 50))}

def loadgen(url, levels, prompt_tokens=128, max_tokens=64):
    model = json.loads(req(url, "GET", "/v1/models")[1])["data"][0]["id"]
    rows = []
    for c in levels:
        lg_one(url, model, prompt_tokens, max_tokens)  # warm-up
        # LOADGEN_PER_LEVEL=N: N requests per level instead of max(8, 4 c) (longer, steadier runs).
        rows.append(lg_level(url, model, c, prompt_tokens, max_tokens, int(os.environ.get("LOADGEN_PER_LEVEL", "0"))))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    lines = ["| concurrency | requests | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | TPOT p50 (ms) |",
             "|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        t, i = r["ttft_ms"], r["itl_ms"]
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['req_per_s']} | {r['output_tok_per_s']} | "
                     f"{t['p50']} / {t['p90']} / {t['p99']} | {i['p50']} / {i['p90']} / {i['p99']} | {r['tpot_ms_p50']} |")
    return {"rows": rows, "table": "\n".join(lines)}

# ---- agent loops: scripts/loadgen.mjs --agent-turns, transcribed (one session) ----
def agent(url, path, turns, first_chars=6000, turn_chars=400, max_tokens=32):
    """Each turn resends everything so far (prompt, answers, the next turn_chars of the file):
    time to first token and the prompt tokens the server took from its prefix cache, by turn."""
    model = json.loads(req(url, "GET", "/v1/models")[1])["data"][0]["id"]
    text = open(path, encoding="utf-8").read()
    at, rows = first_chars, []
    prompt = text[:at]
    for t in range(turns):
        t0 = time.perf_counter()
        st, ev, times = stream(url, "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}})
        if st != 200 or not times:
            raise RuntimeError(f"HTTP {st}: {ev}")
        usage = [e for e in ev if e != "[DONE]" and e.get("usage")][-1]["usage"]
        rows.append({"turn": t, "prompt_tokens": usage["prompt_tokens"],
                     "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
                     "ttft_ms": round((times[0] - t0) * 1000, 1)})
        prompt += streamed_text(ev) + text[at:at + turn_chars]
        at += turn_chars
    return rows

# ---- a long prompt arriving among decoding streams ----
def long_prompt(url, path, chars, streams=4):
    """`streams` short streamed requests decoding; 0.5 s in, one prompt of the file's first `chars`
    characters (1 token out): its time to first token, and the gaps between the short streams'
    tokens (the steps the long prompt's pieces share with their decodes)."""
    model = json.loads(req(url, "GET", "/v1/models")[1])["data"][0]["id"]
    text = open(path, encoding="utf-8").read()[:chars]
    gaps, out = [], {}
    def short(i):
        st, ev, times = stream(url, "/v1/completions", {"model": model, "prompt": lg_prompt(10_000 + i, 64),
            "max_tokens": 160, "temperature": 0, "stream": True, "ignore_eos": True})
        gaps.extend((b - a) * 1000 for a, b in zip(times, times[1:]))
    th = [threading.Thread(target=short, args=(i,)) for i in range(streams)]
    [t.start() for t in th]
    time.sleep(0.5)
    t0 = time.perf_counter()
    st, ev, times = stream(url, "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    out["long_prompt_tokens"] = [e for e in ev if e != "[DONE]" and e.get("usage")][-1]["usage"]["prompt_tokens"]
    out["long_ttft_ms"] = round((times[0] - t0) * 1000, 1)
    [t.join() for t in th]
    f = lambda x: round(x, 1)
    out["short_itl_ms"] = {"p50": f(pct(gaps, 50)), "p99": f(pct(gaps, 99)), "max": f(max(gaps))}
    return out

if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("smoke", "ids", "mixed", "loadgen", "agent", "long"):
        sys.exit(__doc__.splitlines()[-1].strip())
    cmd, url = sys.argv[1], sys.argv[2]
    if cmd == "smoke":
        print(json.dumps(smoke(url), indent=1))
    elif cmd == "ids":
        print(json.dumps(greedy_ids(url, [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4]), int(sys.argv[5]))))
    elif cmd == "mixed":
        print(json.dumps(mixed(url, [int(x) for x in sys.argv[3].split(",")], int(sys.argv[4]))))
    elif cmd == "loadgen":
        r = loadgen(url, [int(x) for x in sys.argv[3].split(",")])
        print(json.dumps(r["rows"]))
        print(r["table"])
    elif cmd == "long":
        print(json.dumps(long_prompt(url, sys.argv[3], int(sys.argv[4]))))
    elif cmd == "agent":
        for row in agent(url, sys.argv[3], int(sys.argv[4])):
            print(json.dumps(row))
