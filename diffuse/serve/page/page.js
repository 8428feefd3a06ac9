// The page of `diffuse serve`: chat with a language model (streamed), generate pictures, videos and sounds (shown by
// results.js), and the ring live (ring.js). It speaks the same OpenAI-shaped API as any client.
"use strict";

const $ = (id) => document.getElementById(id);
const keyInput = $("api-key");
keyInput.value = localStorage.getItem("diffuse-api-key") || "";
keyInput.addEventListener("change", () => { localStorage.setItem("diffuse-api-key", keyInput.value); load(); });

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  if (keyInput.value) h["Authorization"] = "Bearer " + keyInput.value;
  return h;
}

async function api(path, options = {}) {
  const r = await fetch(path, { ...options, headers: { ...headers(options.body !== undefined), ...(options.headers || {}) } });
  if (!r.ok) {
    let message = r.status + " " + r.statusText;
    try { message = (await r.json()).error.message; } catch (e) { /* not JSON */ }
    throw new Error(message);
  }
  return r;
}

// Server-sent events from a fetch response: calls onData with each parsed `data:` payload.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onData(JSON.parse(data));
      }
    }
  }
}

let models = [];

async function load() {
  try {
    models = (await (await api("/v1/models")).json()).data;
  } catch (e) {
    $("health").textContent = "cannot list models: " + e.message;
    return;
  }
  fill($("chat-model"), models.filter((m) => m.kind === "chat"));
  fill($("gen-model"), models.filter((m) => ["image", "video", "speech", "audio"].includes(m.kind)));
  showAttach();
}

function fill(select, list) {
  select.innerHTML = "";
  for (const m of list) {
    const o = document.createElement("option");
    o.value = m.id;
    o.textContent = m.id + (m.kind === "chat" ? "" : " (" + m.kind + ")");
    select.appendChild(o);
  }
  select.disabled = list.length === 0;
  select.closest("section").classList.toggle("empty", list.length === 0);
}

function model(id) { return models.find((m) => m.id === id) || {}; }

function showAttach() {
  const m = model($("chat-model").value);
  $("chat-attach-label").classList.toggle("hidden", !(m.capabilities && m.capabilities.vision));
}
$("chat-model").addEventListener("change", showAttach);

// ---------------------------------------------------------------------------------------------- chat

let history = [];
let stopper = null;

function say(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("chat-log").appendChild(div);
  $("chat-log").scrollTop = $("chat-log").scrollHeight;
  return div;
}

// how an answer was made (asked with "figures": true): trips around the ring, drafts, speed
function figuresLine(f) {
  const parts = [`${f.tokens} tokens in ${f.trips} trips around the ring (${f.tokens_per_trip} a trip)`];
  if (f.drafted) parts.push(`${f.accepted} of ${f.drafted} drafted tokens accepted`);
  else parts.push("no drafts");
  if (f.tokens_per_s) parts.push(`${f.tokens_per_s} tokens/s after the first`);
  if (f.first_token_s != null) parts.push(`first token ${Math.round(f.first_token_s * 1000)} ms`);
  return parts.join(", ");
}

function readFile(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

async function send(event) {
  event.preventDefault();
  const text = $("chat-input").value.trim();
  if (!text || stopper) return;
  $("chat-input").value = "";
  let content = text;
  const file = $("chat-image").files[0];
  const shown = say("user", text);
  if (file && !$("chat-attach-label").classList.contains("hidden")) {
    const url = await readFile(file);
    content = [{ type: "image_url", image_url: { url } }, { type: "text", text }];
    const img = document.createElement("img");
    img.src = url;
    shown.prepend(img);
    $("chat-image").value = "";
  }
  history.push({ role: "user", content });
  const out = say("assistant", "");
  stopper = new AbortController();
  $("chat-send").disabled = true;
  $("chat-stop").disabled = false;
  try {
    const r = await api("/v1/chat/completions", {
      method: "POST", signal: stopper.signal,
      body: JSON.stringify({ model: $("chat-model").value, messages: history, stream: true,
                             figures: $("chat-figures").checked }),
    });
    await readEvents(r, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.figures) say("figures", figuresLine(chunk.figures));
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        out.textContent += delta.content;
        $("chat-log").scrollTop = $("chat-log").scrollHeight;
      }
    });
    history.push({ role: "assistant", content: out.textContent });
  } catch (e) {
    history.pop();
    if (e.name !== "AbortError") say("error", e.message);
  } finally {
    out.classList.add("done");
    stopper = null;
    $("chat-send").disabled = false;
    $("chat-stop").disabled = true;
  }
}

$("chat-form").addEventListener("submit", send);
$("chat-input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("chat-form").requestSubmit(); }
});
$("chat-stop").addEventListener("click", () => stopper && stopper.abort());
$("chat-clear").addEventListener("click", () => { history = []; $("chat-log").innerHTML = ""; });

// ---------------------------------------------------------------------------------------------- generate

function progress(value, text) {
  $("gen-progress").value = value;
  $("gen-status").textContent = text;
}

async function blobUrl(path) {
  return URL.createObjectURL(await (await api(path)).blob());
}

async function generate(event) {
  event.preventDefault();
  const m = model($("gen-model").value);
  const prompt = $("gen-prompt").value.trim();
  if (!prompt) { progress(0, "write a prompt first"); return; }
  const body = { model: m.id, prompt, seed: Number($("gen-seed").value || 0) };
  if ($("gen-steps").value) body.steps = Number($("gen-steps").value);
  if ($("gen-size").value.trim()) body.size = $("gen-size").value.trim();
  $("gen-go").disabled = true;
  const t0 = performance.now();
  try {
    if (m.kind === "image") await generateImage(body);
    else if (m.kind === "video") await generateVideo(body);
    else await generateSound(body);
    progress(100, `done in ${((performance.now() - t0) / 1000).toFixed(1)} s`);
  } catch (e) {
    progress(0, "error: " + e.message);
  } finally {
    $("gen-go").disabled = false;
  }
}

async function generateImage(body) {
  progress(0, "queued");
  const r = await api("/v1/images/generations", { method: "POST", body: JSON.stringify({ ...body, stream: true }) });
  await readEvents(r, (e) => {
    if (e.type === "error") throw new Error(e.error.message);
    if (e.type === "image_generation.progress" && e.steps) progress(100 * e.step / e.steps, `step ${e.step} of ${e.steps}`);
    if (e.type === "image_generation.completed") showPicture("data:image/png;base64," + e.b64_json, body.prompt);
  });
}

async function generateVideo(body) {
  let job = await (await api("/v1/videos", { method: "POST", body: JSON.stringify(body) })).json();
  while (job.status === "queued" || job.status === "in_progress") {
    progress(job.progress, job.steps ? `step ${job.step} of ${job.steps}` : job.status);
    await new Promise((ok) => setTimeout(ok, 300));
    job = await (await api("/v1/videos/" + job.id)).json();
  }
  if (job.status !== "completed") throw new Error(job.error ? job.error.message : job.status);
  const sheet = await blobUrl(`/v1/videos/${job.id}/content?variant=spritesheet`);
  showPicture(sheet, body.prompt + " (every frame)", "diffuse-frames.png");
  showVideo(await blobUrl(`/v1/videos/${job.id}/content`), body.prompt);
}

async function generateSound(body) {
  progress(0, "voicing");
  const ask = { model: body.model, input: body.prompt, seed: body.seed, ...(body.steps ? { steps: body.steps } : {}) };
  const r = await api("/v1/audio/speech", { method: "POST", body: JSON.stringify(ask) });
  showSound(URL.createObjectURL(await r.blob()), body.prompt);
}

$("gen-form").addEventListener("submit", generate);
load();
watchRing();
