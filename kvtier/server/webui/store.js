// Conversations, settings and the API key, kept in this browser's localStorage.
//
//   kvtier.conversations  [{id, title, updated, messages: [{role, content, reasoning?, tool_calls?, stats?}]}]
//   kvtier.current        id of the open conversation
//   kvtier.settings       {system, temperature, top_p, max_tokens, tools (JSON text), theme}
//   kvtier.key            API key (from the settings box or a one-time #key=... link)
"use strict";

const KvStore = (() => {
  const K_CONV = "kvtier.conversations", K_CUR = "kvtier.current", K_SET = "kvtier.settings", K_KEY = "kvtier.key";
  const DEFAULTS = {system: "", temperature: 0.7, top_p: 0.95, max_tokens: 1024, tools: "", theme: "auto"};

  function read(key, fallback) {
    try {
      const v = JSON.parse(localStorage.getItem(key));
      return v === null || v === undefined ? fallback : v;
    } catch (e) {
      return fallback;
    }
  }
  function write(key, value) {
    try {
      localStorage.setItem(key, JSON.stringify(value));
    } catch (e) {  // quota: keep working in memory
      console.warn("kvtier: could not save", key, e);
    }
  }

  let conversations = read(K_CONV, []);
  if (!Array.isArray(conversations)) conversations = [];

  const newId = () => Date.now().toString(36) + Math.random().toString(36).slice(2, 8);

  return {
    list: () => conversations.slice().sort((a, b) => b.updated - a.updated),
    get: id => conversations.find(c => c.id === id) || null,
    create() {
      const c = {id: newId(), title: "New chat", updated: Date.now(), messages: []};
      conversations.push(c);
      this.save(c);
      return c;
    },
    save(c) {
      c.updated = Date.now();
      write(K_CONV, conversations);
      write(K_CUR, c.id);
    },
    remove(id) {
      conversations = conversations.filter(c => c.id !== id);
      write(K_CONV, conversations);
    },
    select: id => write(K_CUR, id),
    currentId: () => read(K_CUR, null),
    settings: () => ({...DEFAULTS, ...read(K_SET, {})}),
    saveSettings: s => write(K_SET, s),
    key: () => localStorage.getItem(K_KEY) || "",
    setKey(k) {
      if (k) localStorage.setItem(K_KEY, k);
      else localStorage.removeItem(K_KEY);
    },
    // A `#key=...` fragment (printed by `kvtier serve`) logs the page in once: the key is
    // stored, then removed from the address bar and history. Fragments never reach the server.
    takeKeyFromUrl() {
      const params = new URLSearchParams(location.hash.slice(1));
      const k = params.get("key");
      if (k === null) return false;
      this.setKey(k);
      history.replaceState(null, "", location.pathname + location.search);
      return true;
    },
  };
})();
