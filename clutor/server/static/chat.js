// Clutor's chat page: one conversation streamed from /v1/chat/completions, reasoning shown apart,
// each reply's stats (tok/s, expert-cache hit rate, bytes read) from the stream's last chunk.
"use strict";

const $ = (id) => document.getElementById(id);
const log = $("log"), input = $("input"), send = $("send"), stop = $("stop"), status = $("status");
const keyField = $("api-key");
keyField.value = localStorage.getItem("clutor.apiKey") || "";
keyField.addEventListener("change", () => localStorage.setItem("clutor.apiKey", keyField.value));

let messages = [];
let model = null;
let controller = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  if (keyField.value) h["Authorization"] = "Bearer " + keyField.value;
  return h;
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : r.statusText);
    const m = body.data[0];
    model = m.id;
    $("model").textContent = m.id + (m.meta && m.meta.n_ctx ? " · context " + m.meta.n_ctx : "");
  } catch (e) {
    $("model").textContent = "not ready: " + e.message;
    setTimeout(loadModel, 2000);
  }
}

function bubble(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const content = document.createElement("div");
  content.className = "content";
  div.appendChild(content);
  log.appendChild(div);
  log.scrollTop = log.scrollHeight;
  return div;
}

function human(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return (i ? n.toFixed(1) : n) + " " + units[i];
}

function showStats(div, t, usage, finish) {
  const parts = [];
  if (t) {
    parts.push(t.predicted_n + " tokens, " + t.predicted_per_second.toFixed(1) + " tok/s");
    parts.push("prompt " + t.prompt_n + (t.cache_n ? " (+" + t.cache_n + " cached)" : "") + " at " +
               t.prompt_per_second.toFixed(1) + " tok/s");
    if (t.experts) {
      parts.push("hit rate " + (100 * t.experts.hit_rate).toFixed(1) + "%");
      parts.push("read " + human(t.experts.bytes_read));
    }
  } else if (usage) {
    parts.push(usage.completion_tokens + " tokens");
  }
  if (finish && finish !== "stop") parts.push("finish: " + finish);
  const s = document.createElement("div");
  s.className = "stats";
  s.textContent = parts.join(" · ");
  div.appendChild(s);
}

function reasoningBox(div) {
  let box = div.querySelector("details.reasoning");
  if (!box) {
    box = document.createElement("details");
    box.className = "reasoning";
    box.open = true;
    const sum = document.createElement("summary");
    sum.textContent = "Reasoning";
    const text = document.createElement("div");
    text.className = "text";
    box.appendChild(sum);
    box.appendChild(text);
    div.insertBefore(box, div.firstChild);
  }
  return box.querySelector(".text");
}

// Server-sent events from a fetch body: "data: {...}" lines, blank-line separated.
async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let i;
    while ((i = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, i);
      buf = buf.slice(i + 2);
      for (const line of block.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        yield JSON.parse(data);
      }
    }
  }
}

async function ask(text) {
  messages.push({ role: "user", content: text });
  bubble("user").querySelector(".content").textContent = text;
  const div = bubble("assistant");
  const content = div.querySelector(".content");
  let reply = "", reasoning = "", calls = {}, finish = null, timings = null, usage = null;
  controller = new AbortController();
  send.disabled = true; stop.disabled = false;
  status.textContent = "waiting for the first token…";
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({
        model: model, messages: messages, stream: true, stream_options: { include_usage: true },
        temperature: parseFloat($("temperature").value), max_tokens: parseInt($("max-tokens").value, 10),
      }),
    });
    if (!r.ok) {
      const body = await r.json().catch(() => ({}));
      throw new Error(body.error ? body.error.message : r.status + " " + r.statusText);
    }
    status.textContent = "streaming…";
    for await (const ev of events(r)) {
      if (ev.error) throw new Error(ev.error.message);
      if (ev.usage) usage = ev.usage;
      if (ev.timings) timings = ev.timings;
      const ch = ev.choices && ev.choices[0];
      if (!ch) continue;
      const d = ch.delta || {};
      if (d.reasoning_content) { reasoning += d.reasoning_content; reasoningBox(div).textContent = reasoning; }
      if (d.content) { reply += d.content; content.textContent = reply; }
      for (const tc of d.tool_calls || []) {
        const c = calls[tc.index] || (calls[tc.index] = { name: "", arguments: "" });
        if (tc.function && tc.function.name) c.name = tc.function.name;
        if (tc.function && tc.function.arguments) c.arguments += tc.function.arguments;
      }
      if (ch.finish_reason) finish = ch.finish_reason;
      log.scrollTop = log.scrollHeight;
    }
    const msg = { role: "assistant", content: reply };
    if (reasoning) msg.reasoning_content = reasoning;
    messages.push(msg);
    showStats(div, timings, usage, finish);
    status.textContent = "";
  } catch (e) {
    if (e.name === "AbortError") {
      status.textContent = "stopped";
      if (reply) messages.push({ role: "assistant", content: reply });
    } else {
      div.classList.add("error");
      content.textContent = (reply ? reply + "\n\n" : "") + "Error: " + e.message;
      messages.pop();
      status.textContent = "";
    }
  } finally {
    send.disabled = false; stop.disabled = true; controller = null;
    input.focus();
  }
}

$("form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = input.value.trim();
  if (!text || controller) return;
  input.value = "";
  ask(text);
});
input.addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
stop.addEventListener("click", () => controller && controller.abort());
$("clear").addEventListener("click", () => { if (!controller) { messages = []; log.textContent = ""; } });

loadModel();
input.focus();
