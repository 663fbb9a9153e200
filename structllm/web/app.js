// structllm's chat page: a client of the server's own OpenAI API (same origin).
// Model text is only ever inserted as text (textContent / text nodes), never as HTML.
"use strict";

const $ = (id) => document.getElementById(id);
let apiKey = null; // kept in this page's memory only
let history = []; // the conversation, as OpenAI messages (the system prompt is added per request)
let controller = null; // the AbortController of the stream in flight

function setState(state, text) {
  document.body.dataset.state = state;
  $("status").textContent = text || "";
}

function showError(text) {
  const e = $("error");
  e.textContent = text;
  e.hidden = !text;
}

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

// -- API access --------------------------------------------------------------------------

class AuthError extends Error {}

async function api(path, init = {}) {
  const headers = Object.assign({}, init.headers || {});
  if (apiKey !== null) headers["Authorization"] = "Bearer " + apiKey;
  const res = await fetch(path, Object.assign({}, init, { headers }));
  if (res.status === 401) {
    askKey(apiKey === null ? "" : "That key was refused.");
    throw new AuthError("the server needs an API key");
  }
  return res;
}

async function errorText(res) {
  try {
    const body = await res.json();
    if (body && body.error && body.error.message) return `${res.status}: ${body.error.message}`;
  } catch (e) { /* not JSON */ }
  return `HTTP ${res.status}`;
}

// -- API key -----------------------------------------------------------------------------

function askKey(message) {
  setState("key", "waiting for the API key");
  $("key-dialog").hidden = false;
  $("key-error").textContent = message;
  $("key-error").hidden = !message;
  $("key-input").value = "";
  $("key-input").focus();
}

$("key-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  apiKey = $("key-input").value;
  $("key-dialog").hidden = true;
  if (await loadModels()) pollMetrics();
});

// -- models ------------------------------------------------------------------------------

async function loadModels() {
  let res;
  try {
    res = await api("/v1/models");
  } catch (e) {
    if (!(e instanceof AuthError)) $("conn").textContent = "server unreachable";
    return false;
  }
  if (!res.ok) {
    $("conn").textContent = await errorText(res);
    return false;
  }
  const select = $("model");
  const current = select.value;
  select.replaceChildren();
  for (const m of (await res.json()).data) {
    const opt = el("option", null, m.id);
    opt.value = m.id;
    select.append(opt);
  }
  if (current) select.value = current;
  $("conn").textContent = "";
  setState("idle", "ready");
  return true;
}

// -- chat --------------------------------------------------------------------------------

function addMessage(role, text, images = []) {
  const box = el("div", "msg " + role);
  box.append(el("span", "role", role));
  const content = el("span", "content");
  if (text) content.append(document.createTextNode(text));
  box.append(content);
  if (images.length) box.append(thumbnails(images));
  $("messages").append(box);
  box.scrollIntoView({ block: "end" });
  return box;
}

function parseJsonField(id, what) {
  const text = $(id).value.trim();
  if (!text) return null;
  try {
    return JSON.parse(text);
  } catch (e) {
    throw new Error(`${what} is not valid JSON: ${e.message}`);
  }
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  const body = {
    model: $("model").value || undefined,
    messages: messages.concat(history),
    stream: true,
    stream_options: { include_usage: true },
  };
  // an empty field leaves the server's default
  const temperature = $("temperature").value.trim();
  if (temperature) body.temperature = Number(temperature);
  const maxTokens = $("max-tokens").value.trim();
  if (maxTokens) body.max_tokens = Number(maxTokens);
  if ($("logprobs").checked) {
    body.logprobs = true;
    body.top_logprobs = 5;
  }
  if ($("json-mode").checked) {
    const schema = parseJsonField("json-schema", "the JSON schema");
    body.response_format = schema === null
      ? { type: "json_object" }
      : { type: "json_schema", json_schema: { name: "page_schema", schema, strict: true } };
  }
  if ($("tool-mode").checked) {
    const tool = parseJsonField("tool-def", "the tool definition");
    if (tool !== null) {
      body.tools = [tool];
      // after a tool's result the model may answer in text (`required` would force
      // another call)
      const afterResult = history.length && history[history.length - 1].role === "tool";
      body.tool_choice = afterResult ? "auto" : $("tool-choice").value;
      body.parallel_tool_calls = false; // one call per turn, answered before the next

    }
  }
  const extra = parseJsonField("extra", "the other request fields");
  if (extra !== null) Object.assign(body, extra);
  return body;
}

function describeLogprob(lp) {
  const pct = (x) => (100 * Math.exp(x)).toFixed(1) + "%";
  const lines = [`${JSON.stringify(lp.token)}  ${pct(lp.logprob)}  (logprob ${lp.logprob.toFixed(3)})`];
  for (const alt of lp.top_logprobs || []) lines.push(`  ${JSON.stringify(alt.token)}  ${pct(alt.logprob)}`);
  return lines.join("\n");
}

// One assistant reply as it streams: text (with logprobs, a span per chunk whose title
// shows the tokens' probabilities), tool calls by index, the finish reason and usage.
class Reply {
  constructor() {
    this.box = addMessage("assistant", "");
    this.content = this.box.querySelector(".content");
    this.text = "";
    this.calls = [];
    this.finish = null;
    this.usage = null;
    this.chunks = 0;
    this.box.dataset.chunks = "0";
  }

  feed(chunk) {
    this.chunks += 1;
    this.box.dataset.chunks = String(this.chunks);
    if (chunk.usage) this.usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      const delta = choice.delta || {};
      if (delta.content) this.addText(delta.content, choice.logprobs);
      for (const tc of delta.tool_calls || []) this.addCall(tc);
      if (choice.finish_reason) this.finish = choice.finish_reason;
    }
  }

  addText(text, logprobs) {
    this.text += text;
    const lps = logprobs && logprobs.content;
    if (lps && lps.length) {
      const span = el("span", "tok", text);
      span.title = lps.map(describeLogprob).join("\n");
      const p = Math.exp(Math.min(...lps.map((x) => x.logprob)));
      span.style.backgroundColor = `rgba(224, 122, 31, ${(0.45 * (1 - p)).toFixed(3)})`;
      this.content.append(span);
    } else {
      this.content.append(document.createTextNode(text));
    }
    this.box.scrollIntoView({ block: "end" });
  }

  addCall(tc) {
    let call = this.calls[tc.index];
    if (!call) {
      call = { id: tc.id, name: "", args: "", node: el("div", "tool-call") };
      call.node.append(el("span", "label", "call "), el("span", "name"), el("span", "args"));
      this.calls[tc.index] = call;
      this.box.append(call.node);
    }
    if (tc.id) call.id = tc.id;
    if (tc.function && tc.function.name) call.name += tc.function.name;
    if (tc.function && tc.function.arguments) call.args += tc.function.arguments;
    call.node.querySelector(".name").textContent = call.name;
    call.node.querySelector(".args").textContent = "(" + call.args + ")";
  }

  note(text, cls) {
    this.box.append(el("span", "note" + (cls ? " " + cls : ""), text));
  }

  message() {
    const msg = { role: "assistant", content: this.text || null };
    const calls = this.calls.filter(Boolean);
    if (calls.length) {
      msg.tool_calls = calls.map((c) => ({
        id: c.id, type: "function", function: { name: c.name, arguments: c.args },
      }));
    }
    return msg;
  }
}

async function readEvents(res, onEvent) {
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buf += decoder.decode(value, { stream: true });
    let end;
    while ((end = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, end);
      buf = buf.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

async function generate() {
  let body;
  try {
    body = requestBody();
  } catch (e) {
    showError(e.message);
    return;
  }
  showError("");
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  setState("streaming", "generating…");
  const reply = new Reply();
  const started = performance.now();
  let state = "done";
  try {
    const res = await api("/v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!res.ok) throw new Error(await errorText(res));
    await readEvents(res, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message || "the server reported an error");
      reply.feed(chunk);
    });
  } catch (e) {
    if (e.name === "AbortError") {
      state = "stopped";
      reply.note("stopped", "bad");
    } else {
      state = e instanceof AuthError ? "key" : "error";
      if (state === "key") {
        unsend(); // sent again once there is a key
      } else {
        showError(e.message);
        reply.note("failed", "bad");
      }
    }
  } finally {
    controller = null;
    $("send").disabled = false;
    $("stop").disabled = true;
  }
  if (reply.text || reply.calls.length) history.push(reply.message());
  else if (state !== "done") reply.box.remove();
  if (state === "done") finishReply(reply, body, performance.now() - started);
  if (state !== "key") setState(state, state === "done" ? "done" : state);
}

// Take the last user message back into the input box (its request was refused for
// want of a key).
function unsend() {
  const last = history[history.length - 1];
  if (!last || last.role !== "user") return;
  history.pop();
  const boxes = document.querySelectorAll("#messages .msg.user");
  if (boxes.length) boxes[boxes.length - 1].remove();
  $("input").value = messageText(last);
}

// The text of a user message, whose content is a string or (with images) a list of parts.
function messageText(msg) {
  if (typeof msg.content === "string") return msg.content;
  return msg.content.filter((p) => p.type === "text").map((p) => p.text).join("");
}

function finishReply(reply, body, ms) {
  const parts = [];
  if (reply.finish) parts.push(reply.finish);
  if (reply.usage) {
    const n = reply.usage.completion_tokens;
    parts.push(`${n} tokens`, `${(n / (ms / 1000)).toFixed(1)} tokens/s`);
  }
  reply.note(parts.join(" · "));
  if (body.response_format && !reply.calls.length) {
    try {
      JSON.parse(reply.text);
      reply.note("valid JSON", "ok");
    } catch (e) {
      reply.note("not valid JSON: " + e.message, "bad");
    }
  }
  for (const call of reply.calls.filter(Boolean)) addResultForm(call);
}

// A call is answered by the user: the result goes back as a `tool` message.
function addResultForm(call) {
  const form = el("form");
  const input = el("input");
  input.placeholder = `result of ${call.name}`;
  const button = el("button", null, "Send result");
  button.type = "submit";
  form.append(input, button);
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    if (controller) return;
    history.push({ role: "tool", tool_call_id: call.id, content: input.value });
    form.replaceWith(el("div", "note", "result: " + input.value));
    generate();
  });
  call.node.append(form);
}

// -- images ------------------------------------------------------------------------------
// Attached images go out as image_url parts with data: URLs (the server decodes and
// checks them); the page shows them from the same URLs (the policy allows data: images).

let attached = []; // data: URLs of the images for the next message

function thumbnails(urls) {
  const row = el("div", "images");
  for (const url of urls) {
    const img = el("img");
    img.src = url; // a data: URL read from the user's own file
    img.alt = "attached image";
    row.append(img);
  }
  return row;
}

function showAttached() {
  $("attached").replaceChildren(...(attached.length ? [thumbnails(attached)] : []));
  $("attached").hidden = !attached.length;
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

$("attach").addEventListener("click", () => $("image-file").click());

$("image-file").addEventListener("change", async () => {
  const files = [...$("image-file").files];
  $("image-file").value = "";
  try {
    for (const f of files) attached.push(await readAsDataURL(f));
  } catch (e) {
    showError("could not read the image: " + e.message);
  }
  showAttached();
});

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  const text = $("input").value;
  if ((!text.trim() && !attached.length) || controller) return;
  $("input").value = "";
  const images = attached;
  attached = [];
  showAttached();
  const content = images.length
    ? [{ type: "text", text }, ...images.map((url) => ({ type: "image_url", image_url: { url } }))]
    : text;
  history.push({ role: "user", content });
  addMessage("user", text, images);
  generate();
});

$("input").addEventListener("keydown", (ev) => {
  if (ev.key === "Enter" && !ev.shiftKey) {
    ev.preventDefault();
    $("composer").requestSubmit();
  }
});

// Closing the stream is the whole protocol: the server cancels the request's task tree
// and the engine aborts it.
$("stop").addEventListener("click", () => controller && controller.abort());

$("clear").addEventListener("click", () => {
  if (controller) controller.abort();
  history = [];
  attached = [];
  showAttached();
  $("messages").replaceChildren();
  showError("");
});

// -- live panel from /metrics ------------------------------------------------------------

const POLL_MS = 1500;
const WINDOW_MS = 60000; // latency percentiles and hit rate over this window
const POINTS = 80; // chart history
const samples = []; // {t, tokens, hits, queries, ttft, itl}
const series = { tps: [], running: [], waiting: [], kv: [], hit: [], ttft: [[], [], []], itl: [[], [], []] };
let polling = false;

function parseMetrics(text) {
  const out = new Map();
  for (const line of text.split("\n")) {
    if (!line || line[0] === "#") continue;
    const r = /^([a-zA-Z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$/.exec(line);
    if (!r) continue;
    const labels = {};
    for (const p of (r[2] || "").matchAll(/(\w+)="((?:[^"\\]|\\.)*)"/g)) labels[p[1]] = p[2];
    if (!out.has(r[1])) out.set(r[1], []);
    out.get(r[1]).push({ labels, value: r[3] === "+Inf" ? Infinity : Number(r[3]) });
  }
  return out;
}

const total = (m, name) => (m.get(name) || []).reduce((s, x) => s + x.value, 0);

function buckets(m, name) {
  return (m.get(name + "_bucket") || [])
    .map((x) => [x.labels.le === "+Inf" ? Infinity : Number(x.labels.le), x.value])
    .sort((a, b) => a[0] - b[0]);
}

// The q-quantile of a cumulative histogram, interpolated within its bucket (as
// Prometheus' histogram_quantile); null without observations.
function quantile(q, b) {
  const n = b.length ? b[b.length - 1][1] : 0;
  if (!(n > 0)) return null;
  const rank = q * n;
  let lo = 0, below = 0;
  for (const [le, c] of b) {
    if (c >= rank) {
      if (le === Infinity) return lo;
      return c === below ? lo : lo + (le - lo) * (rank - below) / (c - below);
    }
    lo = le;
    below = c;
  }
  return lo;
}

const minus = (a, b) => a.map(([le, c], i) => [le, c - (b && b[i] ? b[i][1] : 0)]);
const ms = (s) => (s === null ? "–" : s < 0.1 ? (1000 * s).toFixed(1) + " ms" : (1000 * s).toFixed(0) + " ms");

function push(arr, v) {
  arr.push(v);
  if (arr.length > POINTS) arr.shift();
}

function update(m) {
  const now = performance.now();
  const cur = {
    t: now,
    tokens: total(m, "structllm:engine_generation_tokens_total"),
    hits: total(m, "structllm:prefix_cache_hits_total"),
    queries: total(m, "structllm:prefix_cache_queries_total"),
    ttft: buckets(m, "structllm:time_to_first_token_seconds"),
    itl: buckets(m, "structllm:inter_token_latency_seconds"),
  };
  const prev = samples[samples.length - 1];
  samples.push(cur);
  while (samples.length > 1 && now - samples[0].t > WINDOW_MS) samples.shift();
  const old = samples[0];

  const healthy = total(m, "structllm:engine_healthy") > 0;
  const badge = $("m-health");
  badge.textContent = healthy ? "engine up" : "engine down";
  badge.className = "badge " + (healthy ? "ok" : "bad");
  const running = total(m, "structllm:num_requests_running");
  const waiting = total(m, "structllm:num_requests_waiting");
  const kv = total(m, "structllm:kv_cache_usage_perc");
  $("m-running").textContent = String(running);
  $("m-waiting").textContent = String(waiting);
  $("m-kv").textContent = (100 * kv).toFixed(1) + "%";
  $("m-gen").textContent = String(cur.tokens);
  $("m-reqs").textContent = String(total(m, "structllm:request_success_total"));
  $("m-aborted").textContent = String(total(m, "structllm:engine_requests_aborted_total"));

  const tps = prev ? Math.max(0, cur.tokens - prev.tokens) / ((now - prev.t) / 1000) : 0;
  $("m-tps").textContent = prev ? tps.toFixed(1) : "–";
  const dq = cur.queries - old.queries;
  const hit = dq > 0 ? (cur.hits - old.hits) / dq : cur.queries > 0 ? cur.hits / cur.queries : null;
  $("m-hit").textContent = hit === null ? "–" : (100 * hit).toFixed(1) + "%";

  const qs = [0.5, 0.9, 0.99];
  const ttft = qs.map((q) => quantile(q, minus(cur.ttft, old === cur ? null : old.ttft)));
  const itl = qs.map((q) => quantile(q, minus(cur.itl, old === cur ? null : old.itl)));
  $("m-ttft").textContent = ttft[0] === null ? "" : `p50 ${ms(ttft[0])} · p90 ${ms(ttft[1])} · p99 ${ms(ttft[2])}`;
  $("m-itl").textContent = itl[0] === null ? "" : `p50 ${ms(itl[0])} · p90 ${ms(itl[1])} · p99 ${ms(itl[2])}`;

  push(series.tps, tps);
  push(series.running, running);
  push(series.waiting, waiting);
  push(series.kv, kv);
  push(series.hit, hit);
  qs.forEach((_, i) => {
    push(series.ttft[i], ttft[i]);
    push(series.itl[i], itl[i]);
  });
  chart($("c-tps"), [series.tps], (v) => v.toFixed(0));
  chart($("c-reqs"), [series.running, series.waiting], (v) => v.toFixed(0));
  chart($("c-kv"), [series.kv], (v) => (100 * v).toFixed(0) + "%", 1);
  chart($("c-hit"), [series.hit], (v) => (100 * v).toFixed(0) + "%", 1);
  chart($("c-ttft"), series.ttft, ms);
  chart($("c-itl"), series.itl, ms);
}

const COLORS = ["#2f6fde", "#e07a1f", "#8a4fd8"];

// Line charts on a canvas: one line per series, null values leave gaps.
function chart(canvas, lines, fmt, fixedMax) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  if (canvas.width !== Math.round(w * dpr)) canvas.width = Math.round(w * dpr);
  if (canvas.height !== Math.round(h * dpr)) canvas.height = Math.round(h * dpr);
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  const values = lines.flat().filter((v) => v !== null && Number.isFinite(v));
  const max = fixedMax || Math.max(...values, 0) || 1;
  const pad = 3;
  // a short history is spread over the width (at least 20 points' spacing)
  const span = Math.max(20, ...lines.map((l) => l.length)) - 1;
  lines.forEach((line, li) => {
    g.strokeStyle = COLORS[li];
    g.lineWidth = 1.5;
    g.beginPath();
    let pen = false;
    line.forEach((v, i) => {
      if (v === null || !Number.isFinite(v)) {
        pen = false;
        return;
      }
      const x = w - (line.length - 1 - i) * (w / span);
      const y = h - pad - (h - 2 * pad) * (v / max);
      if (pen) g.lineTo(x, y);
      else g.moveTo(x, y);
      pen = true;
    });
    g.stroke();
  });
  g.fillStyle = "#6b7383";
  g.font = "10px system-ui, sans-serif";
  g.fillText(values.length ? "max " + fmt(max) : "no data", 4, 11);
}

async function pollMetrics() {
  if (polling) return;
  polling = true;
  for (;;) {
    if (!document.hidden) {
      try {
        const res = await api("/metrics");
        if (res.ok) update(parseMetrics(await res.text()));
      } catch (e) {
        if (e instanceof AuthError) {
          polling = false;
          return;
        }
        $("m-health").textContent = "offline";
        $("m-health").className = "badge bad";
      }
    }
    await new Promise((r) => setTimeout(r, POLL_MS));
  }
}

(async () => {
  if (await loadModels()) pollMetrics();
})();
