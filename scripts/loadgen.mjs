#!/usr/bin/env node
// Load generator for tiermoe serve (or any OpenAI-compatible server): streaming completions at
// several concurrency levels; reports requests/s, output tokens/s, time to first token and
// inter-token latency percentiles. Node 18+ (built-in fetch), no dependencies.
//
//   node scripts/loadgen.mjs --url http://127.0.0.1:8000 --concurrency 1,8,32 --requests 64 \
//        --prompt-tokens 128 --max-tokens 64 [--model NAME] [--json]
//
// Agent loops (--agent-turns N): each of --sessions S sessions sends --first-chars of --file,
// then turns that resend everything so far (the prompt, the answers, the next --turn-chars of
// the file as a "tool result"), as agents and multi-turn chats do; reports time to first token
// and the prompt tokens the server took from its prefix cache (usage.prompt_tokens_details), by turn.
//
//   node scripts/loadgen.mjs --agent-turns 6 --file models/tinymix-code/heldout.txt \
//        --first-chars 6000 --turn-chars 400 --sessions 1 --max-tokens 32 [--json]
import { readFileSync } from 'node:fs';

const args = Object.fromEntries(
  process.argv.slice(2).reduce((acc, a, i, all) => {
    if (a.startsWith('--')) acc.push([a.slice(2), all[i + 1] && !all[i + 1].startsWith('--') ? all[i + 1] : 'true']);
    return acc;
  }, []),
);
const url = args.url || 'http://127.0.0.1:8000';
const levels = (args.concurrency || '1,8,32').split(',').map(Number);
const perLevel = Number(args.requests || 0);  // total requests per level (default: 4 per client, at least 8)
const promptTokens = Number(args['prompt-tokens'] || 128);
const maxTokens = Number(args['max-tokens'] || 64);
const timeoutMs = Number(args['timeout-s'] || 600) * 1000;

function prompt(i) {
  // Code-like text; byte-level BPE gives roughly 1 token per 3-4 characters here.
  let s = `# request ${i}\n`;
  for (let k = 0; s.length < promptTokens * 3.5; k++) s += `def f_${i}_${k}(x):\n    return x * ${k} + ${i}\n`;
  return s;
}

const pct = (xs, p) => {
  if (!xs.length) return NaN;
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
};

// One streamed completion of `text`: time to the first and last token, the gaps between tokens,
// the answer and the usage chunk.
async function complete(model, text) {
  const t0 = performance.now();
  const ctrl = AbortSignal.timeout(timeoutMs);
  const res = await fetch(url + '/v1/completions', {
    method: 'POST',
    headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ model, prompt: text, max_tokens: maxTokens, temperature: 0, stream: true,
                           ignore_eos: true, stream_options: { include_usage: true } }),
    signal: ctrl,
  });
  if (res.status !== 200) throw new Error(`HTTP ${res.status}: ${await res.text()}`);
  const dec = new TextDecoder();
  let buf = '', first = null, last = null, done = false, usage = null, answer = '';
  const gaps = [];
  for await (const part of res.body) {
    buf += dec.decode(part, { stream: true });
    let k;
    while ((k = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, k);
      buf = buf.slice(k + 2);
      if (!ev.startsWith('data: ')) continue;
      const data = ev.slice(6);
      if (data === '[DONE]') { done = true; continue; }
      const j = JSON.parse(data);
      if (j.usage) usage = j.usage;
      if (j.choices?.[0]?.text) {
        answer += j.choices[0].text;
        const now = performance.now();
        if (first === null) first = now; else gaps.push(now - last);
        last = now;
      }
    }
  }
  if (!done || !usage) throw new Error('incomplete stream');
  const n = usage.completion_tokens;
  return { ttft: first - t0, e2e: last - t0, gaps, tokens: n, promptTokens: usage.prompt_tokens,
           cachedTokens: usage.prompt_tokens_details?.cached_tokens ?? 0, answer,
           tpot: n > 1 ? (last - first) / (n - 1) : NaN };
}
// Every request's prompt its own (a run-wide counter), so a server's prefix cache finds nothing
// to reuse across requests or levels.
let sent = 0;
const one = (model) => complete(model, prompt(sent++));

async function agentSession(model, s, text, turns) {
  const firstChars = Number(args['first-chars'] || 6000), turnChars = Number(args['turn-chars'] || 400);
  // Each session reads its own stretch of the file, so sessions share nothing.
  const span = firstChars + turns * turnChars;
  let at = (s * span) % Math.max(1, text.length - span);
  let prompt = text.slice(at, (at += firstChars));
  const out = [];
  for (let t = 0; t < turns; ++t) {
    const r = await complete(model, prompt);
    out.push({ turn: t, ...r });
    prompt += r.answer + text.slice(at, (at += turnChars));
  }
  return out;
}

async function level(model, c) {
  const total = perLevel || Math.max(8, 4 * c);
  let next = 0;
  const results = [];
  const t0 = performance.now();
  await Promise.all(Array.from({ length: c }, async () => {
    while (next++ < total) results.push(await one(model));
  }));
  const secs = (performance.now() - t0) / 1000;
  const tokens = results.reduce((a, r) => a + r.tokens, 0);
  const gaps = results.flatMap((r) => r.gaps);
  const f = (x) => Math.round(x * 10) / 10;
  return {
    concurrency: c, requests: results.length, seconds: f(secs),
    prompt_tokens: Math.round(results.reduce((a, r) => a + r.promptTokens, 0) / results.length),
    output_tokens: maxTokens,
    req_per_s: Math.round((results.length / secs) * 100) / 100,
    output_tok_per_s: f(tokens / secs),
    ttft_ms: { p50: f(pct(results.map((r) => r.ttft), 50)), p90: f(pct(results.map((r) => r.ttft), 90)), p99: f(pct(results.map((r) => r.ttft), 99)) },
    itl_ms: { p50: f(pct(gaps, 50)), p90: f(pct(gaps, 90)), p99: f(pct(gaps, 99)) },
    tpot_ms_p50: f(pct(results.map((r) => r.tpot), 50)),
  };
}

const models = await (await fetch(url + '/v1/models')).json();
const model = args.model || models.data[0].id;
if (args['agent-turns']) {
  const turns = Number(args['agent-turns']), sessions = Number(args.sessions || 1);
  const text = readFileSync(args.file || 'models/tinymix-code/heldout.txt', 'utf8');
  const results = (await Promise.all(Array.from({ length: sessions }, (_, s) => agentSession(model, s, text, turns)))).flat();
  const byTurn = Array.from({ length: turns }, (_, t) => {
    const rs = results.filter((r) => r.turn === t);
    return { turn: t, prompt_tokens: pct(rs.map((r) => r.promptTokens), 50), cached_tokens: pct(rs.map((r) => r.cachedTokens), 50),
             ttft_ms_p50: Math.round(pct(rs.map((r) => r.ttft), 50) * 10) / 10 };
  });
  if (args.json) console.log(JSON.stringify({ url, model, sessions, by_turn: byTurn }, null, 2));
  else for (const r of byTurn) console.log(`turn ${r.turn}: ${r.prompt_tokens} prompt tokens, ${r.cached_tokens} cached, TTFT p50 ${r.ttft_ms_p50} ms`);
  process.exit(0);
}
const rows = [];
for (const c of levels) {
  await one(model);  // warm-up
  rows.push(await level(model, c));
  if (!args.json) console.error(JSON.stringify(rows.at(-1)));
}
if (args.json) {
  console.log(JSON.stringify({ url, model, rows }, null, 2));
} else {
  console.log('| concurrency | requests | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) | TPOT p50 (ms) |');
  console.log('|---:|---:|---:|---:|---|---|---:|');
  for (const r of rows)
    console.log(`| ${r.concurrency} | ${r.requests} | ${r.req_per_s} | ${r.output_tok_per_s} | ${r.ttft_ms.p50} / ${r.ttft_ms.p90} / ${r.ttft_ms.p99} | ${r.itl_ms.p50} / ${r.itl_ms.p90} / ${r.itl_ms.p99} | ${r.tpot_ms_p50} |`);
}
