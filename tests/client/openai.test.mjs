// The official `openai` npm client against tiermoe serve: models, completions, chat
// completions, streaming, and errors surfacing as the client's typed API errors.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import OpenAI from 'openai';
import { startServer, tinymix, chatmlModelDir } from './server.mjs';

let plain, chat, chatDir;

before(async () => {
  chatDir = chatmlModelDir();
  [plain, chat] = await Promise.all([
    startServer(['--model', tinymix]),
    startServer(['--model', chatDir, '--served-model-name', 'tiny-chat']),
  ]);
});

after(async () => {
  if (plain) assert.equal(await plain.stop(), 0);
  if (chat) assert.equal(await chat.stop(), 0);
  if (chatDir) fs.rmSync(chatDir, { recursive: true, force: true });
});

const client = (srv) => new OpenAI({ baseURL: srv.url + '/v1', apiKey: 'unused', maxRetries: 0, timeout: 60000 });

test('models.list', { timeout: 30000 }, async () => {
  const models = await client(plain).models.list();
  assert.deepEqual(models.data.map((m) => m.id), ['tinymix-code']);
});

test('completions: plain and streamed agree', { timeout: 60000 }, async () => {
  const params = { model: 'tinymix-code', prompt: 'def quicksort(xs):', max_tokens: 16, temperature: 0 };
  const c = await client(plain).completions.create(params);
  assert.equal(c.object, 'text_completion');
  assert.equal(c.choices[0].finish_reason, 'length');
  assert.equal(c.usage.completion_tokens, 16);
  assert.equal(c.usage.total_tokens, c.usage.prompt_tokens + 16);
  assert.ok(c.choices[0].text.length > 0);

  const stream = await client(plain).completions.create({ ...params, stream: true, stream_options: { include_usage: true } });
  let text = '', finish = null, usage = null, chunks = 0;
  for await (const chunk of stream) {
    chunks++;
    if (chunk.usage) usage = chunk.usage;
    if (chunk.choices.length === 0) continue;
    text += chunk.choices[0].text;
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
  }
  assert.ok(chunks > 2);
  assert.equal(text, c.choices[0].text);
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 16);
});

test('completions: stop strings and seeded sampling', { timeout: 60000 }, async () => {
  const base = { model: 'tinymix-code', prompt: 'import numpy as np\n', max_tokens: 12 };
  const a = await client(plain).completions.create({ ...base, temperature: 0.8, top_p: 0.9, seed: 7 });
  const b = await client(plain).completions.create({ ...base, temperature: 0.8, top_p: 0.9, seed: 7 });
  assert.equal(a.choices[0].text, b.choices[0].text);
  const g = await client(plain).completions.create({ ...base, temperature: 0 });
  const t = g.choices[0].text;
  if (t.length > 3) {
    const s = await client(plain).completions.create({ ...base, temperature: 0, stop: [t.slice(1, 3)] });
    assert.equal(s.choices[0].text, t.slice(0, t.indexOf(t.slice(1, 3))));
    assert.equal(s.choices[0].finish_reason, 'stop');
  }
});

test('chat completions with a ChatML template, plain and streamed', { timeout: 60000 }, async () => {
  const params = {
    model: 'tiny-chat',
    messages: [{ role: 'system', content: 'You write Python.' }, { role: 'user', content: 'def add(a, b):' }],
    max_tokens: 12,
    temperature: 0,
  };
  const c = await client(chat).chat.completions.create(params);
  assert.equal(c.object, 'chat.completion');
  assert.equal(c.choices[0].message.role, 'assistant');
  assert.equal(typeof c.choices[0].message.content, 'string');
  assert.ok(c.usage.prompt_tokens > 20);

  const stream = await client(chat).chat.completions.create({ ...params, stream: true });
  let content = '', role = null, finish = null;
  for await (const chunk of stream) {
    assert.equal(chunk.object, 'chat.completion.chunk');
    const d = chunk.choices[0].delta;
    if (d.role) role = d.role;
    if (d.content) content += d.content;
    if (chunk.choices[0].finish_reason) finish = chunk.choices[0].finish_reason;
  }
  assert.equal(role, 'assistant');
  assert.equal(content, c.choices[0].message.content);
  assert.ok(finish === 'length' || finish === 'stop');
});

test('errors arrive as typed API errors, and the server keeps serving', { timeout: 60000 }, async () => {
  const cl = client(plain);
  await assert.rejects(cl.completions.create({ model: 'gpt-9', prompt: 'x' }), (e) => {
    assert.equal(e.status, 404);
    assert.match(e.message, /does not exist/);
    assert.equal(e.code, 'model_not_found');
    return true;
  });
  await assert.rejects(cl.completions.create({ model: 'tinymix-code', prompt: 'x', max_tokens: 0 }), (e) => {
    assert.ok(e instanceof OpenAI.BadRequestError);
    assert.equal(e.param, 'max_tokens');
    return true;
  });
  await assert.rejects(
    cl.chat.completions.create({ model: 'tinymix-code', messages: [{ role: 'user', content: 'hi' }] }),
    (e) => e.status === 400 && /no chat template/.test(e.message),
  );
  const ok = await cl.completions.create({ model: 'tinymix-code', prompt: 'x = ', max_tokens: 2 });
  assert.equal(ok.usage.completion_tokens <= 2, true);
});
