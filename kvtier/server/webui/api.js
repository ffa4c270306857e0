// The page's only network calls, all to this server: the OpenAI chat stream and kvtier's stats.
"use strict";

const KvApi = (() => {
  class ApiError extends Error {
    constructor(status, message) {
      super(message);
      this.status = status;
    }
  }

  function headers(key) {
    const h = {"Content-Type": "application/json"};
    if (key) h.Authorization = "Bearer " + key;
    return h;
  }

  async function failure(r) {
    let msg = r.statusText || "request failed";
    try {
      const j = await r.json();
      msg = (j.error && (j.error.message || j.error)) || msg;
    } catch (e) { /* not JSON: keep the status text */ }
    return new ApiError(r.status, `${r.status}: ${msg}`);
  }

  async function stats(key) {
    const r = await fetch("/v1/kvtier/stats", {headers: headers(key)});
    if (!r.ok) throw await failure(r);
    return r.json();
  }

  // POST /v1/chat/completions with stream: true and call on.{chunk, progress} per SSE frame.
  // Aborting `signal` closes the connection; the server then aborts the request.
  async function streamChat(body, key, signal, on) {
    const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(key), signal,
      body: JSON.stringify({...body, stream: true, stream_options: {include_usage: true}})});
    if (!r.ok) throw await failure(r);
    const reader = r.body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buf += dec.decode(value, {stream: true});
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const frame = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of frame.split("\n")) {
          if (line.startsWith(": progress ")) {
            on.progress(JSON.parse(line.slice(11)));
          } else if (line.startsWith("data: ")) {
            const data = line.slice(6);
            if (data === "[DONE]") continue;
            const j = JSON.parse(data);
            if (j.error) throw new ApiError(0, j.error.message || String(j.error));
            on.chunk(j);
          }
        }
      }
    }
  }

  return {stats, streamChat, ApiError};
})();
