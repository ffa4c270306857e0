// The chat page: conversations, the streaming answer, status line and gauges.
// Model text only reaches the DOM through textContent or KvMarkdown.render (which escapes it).
"use strict";

(() => {
  const $ = id => document.getElementById(id);
  const log = $("log"), input = $("input"), sendBtn = $("send"), stopBtn = $("stop"), emptyEl = $("empty");
  const metaModel = document.querySelector('meta[name="kvtier-model"]').content;
  const fmt = n => Number(n).toLocaleString("en-US");
  const SCROLL_STICK_PX = 80;  // follow the stream while the view is this close to the bottom
  const STATS_POLL_MS = 1500;  // KV gauge refresh while an answer streams

  let settings = KvStore.settings();
  let conv = null;       // the open conversation
  let running = null;    // {controller, msg, view} while an answer streams
  let windowTokens = 0;  // model context length (from /v1/kvtier/stats)
  let modelName = metaModel.startsWith("__") ? "" : metaModel;

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function button(label, cls, title, onclick) {
    const b = el("button", cls, label);
    b.type = "button";
    if (title) b.title = title;
    b.onclick = onclick;
    return b;
  }

  // ---- settings ---------------------------------------------------------------
  const FIELDS = ["system", "temperature", "top_p", "max_tokens", "tools", "theme"];
  function loadSettings() {
    for (const f of FIELDS) $("set-" + f).value = settings[f] ?? "";
    $("set-key").value = KvStore.key();
    document.documentElement.dataset.theme = settings.theme;
  }
  for (const f of FIELDS) {
    $("set-" + f).addEventListener("change", e => {
      const v = e.target.value;
      settings[f] = e.target.type === "number" ? (v === "" ? "" : Number(v)) : v;
      KvStore.saveSettings(settings);
      document.documentElement.dataset.theme = settings.theme;
    });
  }
  $("set-key").addEventListener("change", e => { KvStore.setKey(e.target.value.trim()); refreshStats(); });
  function askForKey(message) {
    $("settings").open = true;
    $("set-key").focus();
    showNotice(message);
  }
  function showNotice(text) {
    let n = $("notice");
    if (!n) { n = el("div", "msg error"); n.id = "notice"; log.prepend(n); }
    n.textContent = "";
    n.append(el("div", "content", text));
  }

  // ---- conversations ------------------------------------------------------------
  function renderList() {
    const nav = $("conversations");
    nav.textContent = "";
    for (const c of KvStore.list()) {
      const row = el("div", "conv" + (conv && c.id === conv.id ? " active" : ""));
      row.append(el("span", "title", c.title),
                 button("\u2715", "link del", "Delete this conversation", e => { e.stopPropagation(); removeConv(c.id); }));
      row.onclick = () => openConv(c.id);
      nav.append(row);
    }
  }
  function openConv(id) {
    if (running) stop();
    conv = (id && KvStore.get(id)) || KvStore.list()[0] || KvStore.create();
    KvStore.select(conv.id);
    renderList();
    renderLog();
    updateContext();
    document.body.classList.remove("sidebar-open");
  }
  function newConv() {
    if (conv && conv.messages.length === 0) { input.focus(); return; }
    if (running) stop();
    conv = KvStore.create();
    openConv(conv.id);
    input.focus();
  }
  function removeConv(id) {
    KvStore.remove(id);
    if (conv && conv.id === id) { conv = null; openConv(null); } else renderList();
  }

  // ---- messages -----------------------------------------------------------------
  function splitThink(msg) {
    // reasoning_content deltas, plus a <think>...</think> block the server left in the text
    let thinking = msg.reasoning || "", answer = msg.content || "", open = false;
    const m = /^\s*<think>/.exec(answer);
    if (m) {
      const rest = answer.slice(m[0].length), end = rest.indexOf("</think>");
      if (end < 0) { thinking += rest; answer = ""; open = true; }
      else { thinking += rest.slice(0, end); answer = rest.slice(end + 8).replace(/^\s+/, ""); }
    }
    return {thinking: thinking.trim(), answer, open};
  }

  function renderLog() {
    for (const n of [...log.children]) if (n !== emptyEl) n.remove();
    emptyEl.hidden = conv.messages.length > 0;
    conv.messages.forEach((m, i) => log.append(messageView(m, i === conv.messages.length - 1).root));
    log.scrollTop = log.scrollHeight;
  }

  function messageView(msg, isLast, live = false) {
    if (msg.role === "user") {
      const root = el("div", "msg user");
      root.append(el("div", "bubble", msg.content));
      return {root};
    }
    const v = {root: el("div", "msg assistant"), think: el("details", "thinking"), thinkSum: el("summary"),
               thinkBody: el("div", "think-body"), content: el("div", "content"), tools: el("div", "tools"),
               status: el("div", "status"), actions: el("div", "actions"), userToggled: false};
    v.think.append(v.thinkSum, v.thinkBody);
    v.think.addEventListener("toggle", () => { if (v.programmatic) v.programmatic = false; else v.userToggled = true; });
    v.root.append(v.think, v.content, v.tools, v.status, v.actions);
    updateView(v, msg, live, isLast);
    return v;
  }

  function setOpen(v, open) {
    if (v.userToggled || v.think.open === open) return;
    v.programmatic = true;
    v.think.open = open;
  }

  function updateView(v, msg, live, isLast) {
    const {thinking, answer, open} = splitThink(msg);
    const stillThinking = live && (open || (!answer && !(msg.tool_calls || []).length && !!msg.reasoning));
    v.think.hidden = !thinking;
    if (thinking) {
      const secs = msg.stats && msg.stats.think_ms ? ` for ${(msg.stats.think_ms / 1000).toFixed(1)} s` : "";
      v.thinkSum.textContent = stillThinking ? "Thinking\u2026" : `Thought${secs}`;
      v.thinkBody.textContent = thinking;
      setOpen(v, stillThinking);
    }
    v.root.classList.toggle("error", !!(msg.stats && msg.stats.error));
    v.content.classList.remove("cursor");
    v.content.innerHTML = KvMarkdown.render(answer);  // escapes all model text
    if (msg.stats && msg.stats.error) v.content.append(el("p", null, msg.stats.error));
    if (live && !stillThinking) (v.content.lastElementChild || v.content).classList.add("cursor");
    renderTools(v.tools, msg.tool_calls || []);
    renderStatus(v.status, msg.stats || {}, live);
    v.actions.textContent = "";
    if (!live) {
      v.actions.append(button("copy", "link", "Copy the answer", () => copy(answer)));
      if (isLast) v.actions.append(button("regenerate", "link regenerate", "Answer again", regenerate));
    }
  }

  function renderTools(box, calls) {
    box.textContent = "";
    for (const c of calls) {
      const card = el("div", "tool-card"), head = el("div", "tool-head");
      head.append(el("span", "badge", "tool call"), el("span", "name", c.function.name || "\u2026"),
                  el("span", "id", c.id || ""));
      let args = c.function.arguments || "";
      try { args = JSON.stringify(JSON.parse(args), null, 2); } catch (e) { /* still streaming: raw text */ }
      const pre = el("pre");
      pre.append(el("code", null, args));
      card.append(head, pre);
      box.append(card);
    }
  }

  function renderStatus(box, s, live) {
    box.textContent = "";
    const parts = [];
    const part = (label, value, unit) => {
      const span = el("span");
      if (label) span.append(label + " ");
      span.append(el("b", null, value));
      if (unit) span.append(" " + unit);
      parts.push(span);
    };
    if (live && s.progress) part("reading the prompt", `${fmt(s.progress.processed)} / ${fmt(s.progress.total)}`);
    else if (live && s.ttft_ms === undefined) parts.push(el("span", null, "waiting for the first token\u2026"));
    if (s.ttft_ms !== undefined) part("TTFT", fmt(Math.round(s.ttft_ms)), "ms");
    if (s.tok_s) part("", s.tok_s.toFixed(1), "tok/s");
    if (s.usage) {
      const p = s.usage.prompt_tokens, cached = (s.usage.prompt_tokens_details || {}).cached_tokens || 0;
      part("prompt", fmt(p), `(${fmt(cached)} cached, ${fmt(p - cached)} new)`);
      part("", fmt(s.usage.completion_tokens), "generated");
    }
    if (s.stopped) parts.push(el("span", null, "stopped"));
    else if (s.finish === "length") parts.push(el("span", null, "cut at max tokens"));
    else if (s.finish === "tool_calls") parts.push(el("span", null, "tool calls"));
    parts.forEach((p, i) => { if (i) box.append(" \u00b7 "); box.append(p); });
  }

  function copy(text) {
    if (navigator.clipboard && window.isSecureContext) { navigator.clipboard.writeText(text); return; }
    const t = el("textarea");
    t.value = text;
    document.body.append(t);
    t.select();
    document.execCommand("copy");
    t.remove();
  }
  log.addEventListener("click", e => {
    if (!e.target.classList.contains("copy-code")) return;
    copy(e.target.closest(".code").querySelector("pre").textContent);
    e.target.textContent = "copied";
    setTimeout(() => { e.target.textContent = "copy"; }, 1200);
  });

  // ---- sending ------------------------------------------------------------------
  function apiMessages(messages) {
    const out = [];
    if (settings.system && settings.system.trim()) out.push({role: "system", content: settings.system});
    for (const m of messages) {
      if (m.role === "user") { out.push({role: "user", content: m.content}); continue; }
      const calls = m.tool_calls || [];
      if (!m.content && !calls.length) continue;  // failed or empty answers are not history
      const a = {role: "assistant", content: m.content};  // as received: the server reuses its KV
      if (m.reasoning) a.reasoning_content = m.reasoning;
      if (calls.length) a.tool_calls = calls;
      out.push(a);
    }
    return out;
  }

  function requestBody(messages) {
    const body = {model: modelName || metaModel, messages: apiMessages(messages)};
    if (settings.temperature !== "") body.temperature = Number(settings.temperature);
    if (settings.top_p !== "") body.top_p = Number(settings.top_p);
    if (settings.max_tokens !== "" && Number(settings.max_tokens) > 0) body.max_tokens = Number(settings.max_tokens);
    if (settings.tools && settings.tools.trim()) {
      try {
        body.tools = JSON.parse(settings.tools);
      } catch (e) {
        throw new Error(`Settings > Tools is not valid JSON (${e.message})`);
      }
    }
    return body;
  }

  function setBusy(busy) {
    sendBtn.hidden = busy;
    stopBtn.hidden = !busy;
    document.body.classList.toggle("busy", busy);
    for (const b of log.querySelectorAll(".regenerate")) b.disabled = busy;
  }

  function nearBottom() { return log.scrollHeight - log.scrollTop - log.clientHeight < SCROLL_STICK_PX; }

  async function generate() {
    const msg = {role: "assistant", content: "", reasoning: "", tool_calls: [], stats: {}};
    const s = msg.stats;
    conv.messages.push(msg);
    KvStore.save(conv);
    emptyEl.hidden = true;
    for (const b of log.querySelectorAll(".regenerate")) b.remove();
    const view = messageView(msg, true, true);
    log.append(view.root);
    log.scrollTop = log.scrollHeight;
    const controller = new AbortController();
    running = {controller, msg, view};
    setBusy(true);
    let frame = 0;
    const redraw = () => {
      if (frame) return;
      frame = requestAnimationFrame(() => {
        frame = 0;
        const stick = nearBottom();
        if (running && running.msg === msg) updateView(view, msg, true, true);
        if (stick) log.scrollTop = log.scrollHeight;
      });
    };
    const t0 = performance.now();
    let tFirst = null, tAnswer = null, deltas = 0;
    const poll = setInterval(refreshStats, STATS_POLL_MS);
    try {
      await KvApi.streamChat(requestBody(conv.messages.slice(0, -1)), KvStore.key(), controller.signal, {
        progress(p) { s.progress = p; redraw(); },
        chunk(j) {
          if (j.usage) s.usage = j.usage;
          for (const c of j.choices || []) {
            const d = c.delta || {};
            let got = false;
            if (d.reasoning_content) { msg.reasoning += d.reasoning_content; got = true; }
            if (d.content) {
              msg.content += d.content;
              got = true;
              if (tAnswer === null && !splitThink(msg).open) tAnswer = performance.now();
            }
            for (const tc of d.tool_calls || []) {
              const slot = msg.tool_calls[tc.index] ||= {id: "", type: "function", function: {name: "", arguments: ""}};
              if (tc.id) slot.id = tc.id;
              if (tc.function && tc.function.name) slot.function.name += tc.function.name;
              if (tc.function && tc.function.arguments) slot.function.arguments += tc.function.arguments;
              got = true;
            }
            if (c.finish_reason) s.finish = c.finish_reason;
            if (got) {
              deltas++;
              if (tFirst === null) { tFirst = performance.now(); s.ttft_ms = tFirst - t0; delete s.progress; }
              const secs = (performance.now() - tFirst) / 1000;
              if (secs > 0.5) s.tok_s = (deltas - 1) / secs;  // live estimate: about one token per delta
            }
          }
          redraw();
        },
      });
    } catch (e) {
      if (e.name === "AbortError") s.stopped = true;
      else {
        s.error = e.message || String(e);
        if (e.status === 401) askForKey("This server needs an API key: enter it under Settings.");
      }
    } finally {
      clearInterval(poll);
      if (frame) cancelAnimationFrame(frame);
      const tEnd = performance.now();
      if (tFirst !== null) {
        const n = s.usage ? s.usage.completion_tokens : deltas;
        const secs = (tEnd - tFirst) / 1000;
        if (n > 1 && secs > 0) s.tok_s = (n - 1) / secs;
        if (msg.reasoning || /^\s*<think>/.test(msg.content)) s.think_ms = (tAnswer || tEnd) - tFirst;
      }
      delete s.progress;
      msg.tool_calls = msg.tool_calls.filter(Boolean);
      if (!msg.tool_calls.length) delete msg.tool_calls;
      if (!msg.reasoning) delete msg.reasoning;
      running = null;
      updateView(view, msg, false, true);
      setBusy(false);
      KvStore.save(conv);
      renderList();
      updateContext();
      refreshStats();
    }
  }

  function submit() {
    const text = input.value.trim();
    if (!text || running) return;
    input.value = "";
    autosize();
    conv.messages.push({role: "user", content: text});
    if (conv.messages.filter(m => m.role === "user").length === 1) conv.title = text.replace(/\s+/g, " ").slice(0, 60);
    KvStore.save(conv);
    renderList();
    emptyEl.hidden = true;
    log.append(messageView(conv.messages[conv.messages.length - 1], false).root);
    generate();
  }

  function regenerate() {
    if (running) return;
    while (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") conv.messages.pop();
    renderLog();
    generate();
  }

  function stop() {
    if (running) running.controller.abort();  // closes the connection: the server aborts the request
  }

  // ---- gauges -------------------------------------------------------------------
  function setSeg(seg, part, whole) {
    seg.style.width = whole > 0 ? `${Math.min(100, (100 * part) / whole)}%` : "0";
  }

  function updateContext() {
    const segs = $("context").querySelectorAll(".seg");
    const last = conv && [...conv.messages].reverse().find(m => m.stats && m.stats.usage);
    const u = last ? last.stats.usage : {prompt_tokens: 0, completion_tokens: 0};
    const cached = (u.prompt_tokens_details || {}).cached_tokens || 0;
    const used = u.prompt_tokens + u.completion_tokens;
    setSeg(segs[0], cached, windowTokens);
    setSeg(segs[1], u.prompt_tokens - cached, windowTokens);
    setSeg(segs[2], u.completion_tokens, windowTokens);
    $("context-text").textContent = windowTokens ? `${fmt(used)} / ${fmt(windowTokens)}` : fmt(used);
    $("context").title = `This conversation's last request: ${fmt(cached)} prompt tokens from the KV cache, ` +
      `${fmt(u.prompt_tokens - cached)} new, ${fmt(u.completion_tokens)} generated; ` +
      `context window ${windowTokens ? fmt(windowTokens) : "unknown"} tokens`;
  }

  function poolGauge(box, name, tier) {
    const held = tier.pages_used + tier.pages_cached;
    const pct = tier.pages_total ? (100 * held) / tier.pages_total : 0;
    const bar = el("div", "bar small"), used = el("span", "seg used"), cache = el("span", "seg cache");
    bar.append(used, cache);
    setSeg(used, tier.pages_used, tier.pages_total);
    setSeg(cache, tier.pages_cached, tier.pages_total);
    box.append(el("span", "tier", name), bar, el("span", "tier", held && pct < 1 ? "<1%" : `${Math.round(pct)}%`));
  }

  async function refreshStats() {
    let st;
    try {
      st = await KvApi.stats(KvStore.key());
    } catch (e) {
      if (e.status === 401) askForKey("This server needs an API key: enter it under Settings, " +
                                      "or open the link that `kvtier serve` printed.");
      return;
    }
    const notice = $("notice");
    if (notice) notice.remove();
    windowTokens = st.max_model_len || 0;
    if (!modelName) modelName = st.model;
    $("model").textContent = modelName;
    $("empty-model").textContent = modelName;
    const pool = $("pool");
    pool.textContent = "";
    pool.append(el("span", "gauge-label", `KV ${st.kv_format || ""}`.trim()));
    const tier = st.device === "cuda" ? "GPU" : "CPU";  // the first tier lives on the compute device
    poolGauge(pool, tier, st.gpu);
    if (st.host.pages_total) poolGauge(pool, "host", st.host);
    pool.title = `KV pages (${st.kv_format || "?"}): ${tier} ${fmt(st.gpu.pages_used)} held, ${fmt(st.gpu.pages_cached)} ` +
      `prefix cache, ${fmt(st.gpu.pages_free)} free of ${fmt(st.gpu.pages_total)}` +
      (st.host.pages_total ? `; host ${fmt(st.host.pages_used)} held, ${fmt(st.host.pages_cached)} prefix cache, ` +
       `${fmt(st.host.pages_free)} free of ${fmt(st.host.pages_total)}` : "; no host tier") +
      `. Running ${st.running}, waiting ${st.waiting}.`;
    updateContext();
  }

  // ---- composer -----------------------------------------------------------------
  function autosize() {
    input.style.height = "auto";
    input.style.height = `${input.scrollHeight + 2}px`;
  }
  input.addEventListener("input", autosize);
  input.addEventListener("keydown", e => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); submit(); }
  });
  document.addEventListener("keydown", e => { if (e.key === "Escape" && running) stop(); });
  $("composer").addEventListener("submit", e => { e.preventDefault(); submit(); });
  stopBtn.onclick = stop;
  $("new-chat").onclick = newConv;
  $("toggle-sidebar").onclick = () => document.body.classList.toggle("sidebar-open");

  // ---- start --------------------------------------------------------------------
  KvStore.takeKeyFromUrl();
  window.addEventListener("hashchange", () => {  // a login link opened in this tab again
    if (KvStore.takeKeyFromUrl()) { loadSettings(); refreshStats(); }
  });
  loadSettings();
  $("model").textContent = modelName;
  $("empty-model").textContent = modelName || "the model";
  openConv(KvStore.currentId());
  refreshStats();
  input.focus();
})();
