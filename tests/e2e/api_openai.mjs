// Driven by tests/e2e/api_openai.sh: the official `openai` npm client against
// `kvasir serve`. argv[2] = path of openai/index.mjs; env KVASIR_TINY_PORT
// (aidreams260K, ring of 2) and KVASIR_CHAT_PORT (qwen3-q8_0, ring of 2).
import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';
import assert from 'node:assert/strict';

const { default: OpenAI, APIError } = await import(pathToFileURL(process.argv[2]).href);
const tinyPort = process.env.KVASIR_TINY_PORT;
const chatPort = process.env.KVASIR_CHAT_PORT;
const shared = process.env.KVASIR_SHARED;

// The reference: llama.cpp's greedy continuation of "Once upon a time" (60 tokens).
const ref = JSON.parse(readFileSync(`${shared}/models/aidreams260K.ref.json`, 'utf8'));
const expected = ', pixels unfolding like petals. Classifications unfold, a kaleidoscope of probability revealing hidden patterns. Classific';
assert.equal(ref.text, expected, 'reference file and README agree');

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function waitHealthy(port) {
  for (let i = 0; i < 300; i++) {
    try {
      const r = await fetch(`http://127.0.0.1:${port}/health`);
      if (r.status === 200) {
        assert.deepEqual(await r.json(), { status: 'ok' });
        return;
      }
      assert.equal(r.status, 503);
      assert.equal((await r.json()).status, 'unavailable');
    } catch (e) {
      if (e instanceof assert.AssertionError) throw e;
    }
    await sleep(100);
  }
  throw new Error(`server on ${port} never became healthy`);
}
async function metrics(port) {
  const r = await fetch(`http://127.0.0.1:${port}/metrics`);
  assert.equal(r.status, 200);
  assert.match(r.headers.get('content-type'), /^text\/plain/);
  return r.text();
}
function metric(text, name) {
  const line = text.split('\n').find((l) => l.startsWith(name + ' '));
  assert.ok(line, `metric ${name} missing`);
  return Number(line.slice(name.length + 1));
}

await waitHealthy(tinyPort);
await waitHealthy(chatPort);
const tiny = new OpenAI({ apiKey: 'none', baseURL: `http://127.0.0.1:${tinyPort}/v1`, maxRetries: 0, timeout: 60000 });
const chat = new OpenAI({ apiKey: 'none', baseURL: `http://127.0.0.1:${chatPort}/v1`, maxRetries: 0, timeout: 60000 });

// models.list
const models = [];
for await (const m of tiny.models.list()) models.push(m.id);
assert.deepEqual(models, ['aidreams260K']);

// completions, non-stream
const req = { model: 'aidreams260K', prompt: 'Once upon a time', max_tokens: 60, temperature: 0 };
const c1 = await tiny.completions.create(req);
assert.equal(c1.object, 'text_completion');
assert.match(c1.id, /^cmpl-/);
assert.equal(c1.model, 'aidreams260K');
assert.equal(c1.choices.length, 1);
assert.equal(c1.choices[0].text, expected);
assert.equal(c1.choices[0].finish_reason, 'length');
assert.deepEqual(c1.usage, { prompt_tokens: ref.prompt.length, completion_tokens: 60, total_tokens: ref.prompt.length + 60 });

// the same, streamed
let streamed = '';
let last = null;
let nChunks = 0;
for await (const ch of await tiny.completions.create({ ...req, stream: true })) {
  assert.equal(ch.object, 'text_completion');
  streamed += ch.choices[0].text;
  last = ch.choices[0].finish_reason;
  nChunks++;
}
assert.equal(streamed, expected);
assert.equal(last, 'length');
assert.ok(nChunks >= 10, `only ${nChunks} chunks`);

// a stop sequence cuts the text (and the request)
const c2 = await tiny.completions.create({ ...req, stop: [' petals'] });
assert.equal(c2.choices[0].text, ', pixels unfolding like');
assert.equal(c2.choices[0].finish_reason, 'stop');

// invalid requests: APIError with status 400
for (const bad of [{ ...req, max_tokens: 0 }, { ...req, temperature: 5 }, { ...req, prompt: ['a', 'b'] }]) {
  await assert.rejects(tiny.completions.create(bad), (e) => {
    assert.ok(e instanceof APIError, `not an APIError: ${e}`);
    assert.equal(e.status, 400);
    assert.equal(e.error?.type ?? e.type, 'invalid_request_error');
    return true;
  });
}
// raw HTTP errors: 404, 405, 413, bad JSON
{
  let r = await fetch(`http://127.0.0.1:${tinyPort}/v1/nothing`);
  assert.equal(r.status, 404);
  assert.equal((await r.json()).error.type, 'invalid_request_error');
  r = await fetch(`http://127.0.0.1:${tinyPort}/v1/completions`);
  assert.equal(r.status, 405);
  r = await fetch(`http://127.0.0.1:${tinyPort}/v1/completions`, { method: 'POST', body: '{"prompt":' });
  assert.equal(r.status, 400);
  assert.equal((await r.json()).error.code, 'invalid_json');
  r = await fetch(`http://127.0.0.1:${tinyPort}/v1/completions`, {
    method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ prompt: 'x'.repeat(1100000) }),
  });
  assert.equal(r.status, 413);
  await r.text();
}

// metrics: 3 successful requests (60 + 60 + 12 tokens), 5 rejected (4 x 400, 413)
{
  const m = await metrics(tinyPort);
  assert.equal(metric(m, 'kvasir_requests_total{status="ok"}'), 3);
  assert.equal(metric(m, 'kvasir_requests_total{status="invalid"}'), 5);
  assert.equal(metric(m, 'kvasir_requests_total{status="cancelled"}'), 0);
  assert.equal(metric(m, 'kvasir_tokens_generated_total'), 132);
  assert.equal(metric(m, 'kvasir_prompt_tokens_total'), 3 * ref.prompt.length);
  assert.equal(metric(m, 'kvasir_request_seconds_count'), 3);
  // consecutive tokens: 59 + 59 + 11 gaps
  assert.equal(metric(m, 'kvasir_token_roundtrip_seconds_count'), 129);
  assert.equal(metric(m, 'kvasir_ring_ready'), 1);
  assert.equal(metric(m, 'kvasir_active_sequences'), 0);
  assert.ok(metric(m, 'kvasir_forward_seconds_total{stage="0"}') > 0);
  assert.ok(metric(m, 'kvasir_link_bytes_total{dir="in"}') > 0);
  assert.ok(metric(m, 'kvasir_link_bytes_total{dir="out"}') > 0);
}

// a client that aborts a stream: the request is cancelled, the server goes on
{
  const ac = new AbortController();
  const s = await tiny.completions.create({ ...req, max_tokens: 100, stream: true }, { signal: ac.signal });
  let got = 0;
  try {
    for await (const ch of s) {
      got++;
      if (got === 3) ac.abort();
    }
  } catch (e) {
    // APIUserAbortError (or an AbortError) is expected
  }
  assert.ok(got >= 3);
  let m = '';
  for (let i = 0; i < 100; i++) {
    m = await metrics(tinyPort);
    if (metric(m, 'kvasir_requests_total{status="cancelled"}') === 1) break;
    await sleep(100);
  }
  assert.equal(metric(m, 'kvasir_requests_total{status="cancelled"}'), 1, m);
  // its slot is freed on the ring
  for (let i = 0; i < 100 && metric(m, 'kvasir_active_sequences') !== 0; i++) {
    await sleep(100);
    m = await metrics(tinyPort);
  }
  assert.equal(metric(m, 'kvasir_active_sequences'), 0);
  const c3 = await tiny.completions.create(req);
  assert.equal(c3.choices[0].text, expected);
  m = await metrics(tinyPort);
  assert.equal(metric(m, 'kvasir_requests_total{status="ok"}'), 4);
}

// chat on qwen3-q8_0 (ChatML template from the GGUF)
{
  const msgs = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Say hello.' }];
  const r = await chat.chat.completions.create({ model: 'qwen3-q8_0', messages: msgs, max_tokens: 8, temperature: 0 });
  assert.equal(r.object, 'chat.completion');
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.equal(typeof r.choices[0].message.content, 'string');
  assert.ok(['stop', 'length'].includes(r.choices[0].finish_reason));
  assert.ok(r.usage.prompt_tokens > 10);
  assert.ok(r.usage.completion_tokens >= 1 && r.usage.completion_tokens <= 8);

  let text = '';
  let first = null;
  let finish = null;
  for await (const ch of await chat.chat.completions.create({ model: 'qwen3-q8_0', messages: msgs, max_tokens: 8, temperature: 0, stream: true })) {
    assert.equal(ch.object, 'chat.completion.chunk');
    if (!first) first = ch.choices[0].delta;
    text += ch.choices[0].delta.content ?? '';
    if (ch.choices[0].finish_reason) finish = ch.choices[0].finish_reason;
  }
  assert.equal(first.role, 'assistant');
  assert.equal(text, r.choices[0].message.content, 'greedy stream equals greedy non-stream');
  assert.equal(finish, r.choices[0].finish_reason);
}
// chat on aidreams260K, which has no chat template: ChatML fallback (as llama-server);
// the stream equals the completion of the ChatML text by hand (greedy)
{
  const msgs = [{ role: 'user', content: 'Once upon a time' }];
  let text = '';
  let first = null;
  let finish = null;
  let n = 0;
  for await (const ch of await tiny.chat.completions.create({ model: 'aidreams260K', messages: msgs, max_tokens: 20, temperature: 0, stream: true })) {
    assert.equal(ch.object, 'chat.completion.chunk');
    assert.match(ch.id, /^chatcmpl-/);
    if (!first) first = ch.choices[0].delta;
    text += ch.choices[0].delta.content ?? '';
    if (ch.choices[0].finish_reason) finish = ch.choices[0].finish_reason;
    n++;
  }
  assert.equal(first.role, 'assistant');
  assert.ok(text.length > 0 && n >= 2, `chat stream gave '${text}' in ${n} chunks`);
  assert.ok(['stop', 'length'].includes(finish));
  const byHand = await tiny.completions.create({ model: 'aidreams260K', prompt: '<|im_start|>user\nOnce upon a time<|im_end|>\n<|im_start|>assistant\n', max_tokens: 20, temperature: 0 });
  assert.equal(text, byHand.choices[0].text, 'ChatML fallback renders <|im_start|>role\\ncontent<|im_end|>\\n');
}
// the ring breaks mid-stream (the tail stage dies): the supervisor restarts
// it, the head holds and replays the request (docs/PROTOCOL.md 5.1), and the
// stream goes on: its text is the undisturbed one, no token twice or missing
{
  const child = Number(process.env.KVASIR_TINY_CHILD);
  assert.ok(child > 0, 'pid of the tail stage');
  const calm = await tiny.completions.create({ ...req, max_tokens: 100 });
  const s = await tiny.completions.create({ ...req, max_tokens: 100, stream: true });
  let got = 0;
  let text = '';
  for await (const ch of s) {
    text += ch.choices[0].text;
    if (++got === 3) process.kill(child, 'SIGKILL');
  }
  assert.ok(got > 3, `the stream ended after ${got} chunks`);
  assert.equal(text, calm.choices[0].text, 'the stream through the fault has the undisturbed text');
  assert.ok(calm.choices[0].text.startsWith(expected.slice(0, 40)));
  const h = await fetch(`http://127.0.0.1:${tinyPort}/health`);
  assert.equal(h.status, 200, 'the ring is whole again');
  const r = await tiny.completions.create(req);
  assert.equal(r.choices[0].text, expected);
}
// serve --api-key-file: the official client with the right key is served; a
// wrong key or none gets OpenAI's 401 error object; /health and /metrics stay open.
{
  const port = process.env.KVASIR_KEYED_PORT;
  const key = process.env.KVASIR_API_KEY;
  assert.ok(port && key, 'keyed server port and key');
  await waitHealthy(port); // no key needed for /health
  const base = { baseURL: `http://127.0.0.1:${port}/v1`, maxRetries: 0, timeout: 60000 };
  const good = new OpenAI({ apiKey: key, ...base });
  const r = await good.completions.create({ model: 'aidreams260K', prompt: 'Once upon a time', max_tokens: 60,
    temperature: 0 });
  assert.equal(r.choices[0].text, expected);
  const bad = new OpenAI({ apiKey: key + 'x', ...base });
  const is401 = (e) => {
    assert.ok(e instanceof APIError, `not an APIError: ${e}`);
    assert.ok(e instanceof OpenAI.AuthenticationError, `not an AuthenticationError: ${e.constructor.name}`);
    assert.equal(e.status, 401);
    assert.equal(e.code, 'invalid_api_key');
    assert.equal(e.type, 'invalid_request_error');
    assert.equal(e.param, null);
    assert.match(e.message, /Incorrect API key provided/);
    assert.ok(!e.message.includes(key), 'the key is not echoed');
    return true;
  };
  await assert.rejects(bad.completions.create({ model: 'aidreams260K', prompt: 'Once upon a time', max_tokens: 4 }),
    is401);
  await assert.rejects(bad.chat.completions.create({ model: 'aidreams260K', messages: [{ role: 'user', content: 'hi' }] }),
    is401);
  await assert.rejects(bad.models.list(), is401);
  const none = await fetch(`http://127.0.0.1:${port}/v1/completions`, { method: 'POST',
    headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ prompt: 'x', max_tokens: 2 }) });
  assert.equal(none.status, 401);
  assert.equal(none.headers.get('www-authenticate'), 'Bearer');
  const body = await none.json();
  assert.deepEqual(Object.keys(body), ['error']);
  assert.deepEqual(Object.keys(body.error), ['message', 'type', 'param', 'code']);
  assert.equal(body.error.code, 'invalid_api_key');
  assert.match(body.error.message, /You didn't provide an API key/);
  const m = await metrics(port); // open without the key
  assert.equal(metric(m, 'kvasir_requests_total{status="ok"}'), 1);
  assert.equal(metric(m, 'kvasir_requests_total{status="invalid"}'), 4);
}
console.log('api_openai: all checks passed');
