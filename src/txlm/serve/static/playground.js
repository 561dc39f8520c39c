// The playground: a prompt, its settings, and the completion streamed as server-sent events
// from /v1/completions; "keep memory" continues one session (POST /v1/sessions once).
"use strict";
const $ = (id) => document.getElementById(id);
let session = null;

function headers() {
  const h = { "Content-Type": "application/json" };
  if ($("key").value) h["Authorization"] = "Bearer " + $("key").value;
  return h;
}

async function describe() {
  const r = await fetch("/v1/models", { headers: headers() });
  if (!r.ok) { $("model").textContent = "model: (" + r.status + ")"; return; }
  const m = (await r.json()).data[0];
  $("model").textContent = "model " + m.id + ": vocabulary " + m.vocab_size +
    ", memory " + m.lengths.mem_len + " tokens";
}

async function newSession() {
  const r = await fetch("/v1/sessions", { method: "POST", headers: headers(), body: "{}" });
  if (!r.ok) throw new Error((await r.json()).error.message);
  return (await r.json()).id;
}

async function generate() {
  const out = $("output");
  $("go").disabled = true;
  $("status").textContent = "generating…";
  try {
    const body = {
      prompt: $("prompt").value,
      max_tokens: Number($("max_tokens").value),
      temperature: Number($("temperature").value),
      top_k: Number($("top_k").value),
      top_p: Number($("top_p").value),
      stream: true,
    };
    if ($("seed").value !== "") body.seed = Number($("seed").value);
    if ($("memory").checked) {
      if (session === null) session = await newSession();
      body.session = session;
    } else {
      out.textContent = "";
    }
    out.textContent += $("prompt").value;
    const r = await fetch("/v1/completions", { method: "POST", headers: headers(),
                                               body: JSON.stringify(body) });
    if (!r.ok) throw new Error((await r.json()).error.message);
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const line = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") { $("status").textContent = "done"; continue; }
        const event = JSON.parse(data);
        if (event.error) throw new Error(event.error.message);
        for (const choice of event.choices) out.textContent += choice.text;
      }
    }
  } catch (err) {
    $("status").textContent = "error: " + err.message;
  } finally {
    $("go").disabled = false;
  }
}

async function forget() {
  if (session !== null) {
    await fetch("/v1/sessions/" + session, { method: "DELETE", headers: headers() });
    session = null;
  }
  $("output").textContent = "";
  $("status").textContent = "memory cleared";
}

$("go").addEventListener("click", generate);
$("forget").addEventListener("click", forget);
describe();
