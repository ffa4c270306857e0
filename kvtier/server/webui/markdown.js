// A small, safe markdown renderer for model output.
//
// Safety rule: every piece of model text goes through esc() before any markup
// is added around it, and link targets are limited to http(s)/mailto. The
// output is therefore an HTML string whose only tags are the ones built here.
// Supported: fenced code (``` / ~~~, highlighted), inline code, headings,
// bold/italic/strike, links, lists (nested by indent), blockquotes, tables,
// horizontal rules, paragraphs. An unclosed fence (mid-stream) runs to the end.
"use strict";

const KvMarkdown = (() => {
  const esc = s => s.replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"})[c]);

  // ---- code highlighting: one tokenizer, keyword sets per language family ----
  const KW = {
    js: "async await break case catch class const continue debugger default delete do else export extends false finally for from function if import in instanceof let new null of return static super switch this throw true try typeof undefined var void while yield interface type enum implements",
    py: "and as assert async await break class continue def del elif else except False finally for from global if import in is lambda None nonlocal not or pass raise return True try while with yield match case self",
    c: "auto break case char const continue default do double else enum extern float for goto if inline int long register return short signed sizeof static struct switch typedef union unsigned void volatile while bool true false nullptr class public private protected template typename namespace using virtual override new delete this std",
    rs: "as async await break const continue crate dyn else enum extern false fn for if impl in let loop match mod move mut pub ref return self Self static struct super trait true type unsafe use where while Some None Ok Err",
    go: "break case chan const continue default defer else fallthrough for func go goto if import interface map package range return select struct switch type var nil true false",
    sh: "if then else elif fi for while do done case esac function in return export local echo exit set unset source cd",
    sql: "select from where and or not insert into values update set delete create table drop alter index join left right inner outer on group by order having limit as distinct null is in like primary key",
    json: "true false null",
  };
  const ALIAS = {javascript: "js", ts: "js", typescript: "js", jsx: "js", tsx: "js", node: "js", python: "py",
    py3: "py", cpp: "c", "c++": "c", cc: "c", h: "c", java: "c", cs: "c", csharp: "c", cuda: "c", rust: "rs",
    golang: "go", bash: "sh", shell: "sh", zsh: "sh", console: "sh", sql: "sql", json: "json", jsonc: "json",
    yaml: "sh", yml: "sh", toml: "sh", dockerfile: "sh", makefile: "sh"};
  const HASH_COMMENT = new Set(["py", "sh"]);
  const sets = {};
  for (const k in KW) sets[k] = new Set(KW[k].split(" "));

  function highlight(code, lang) {
    const fam = ALIAS[(lang || "").toLowerCase()] || (KW[(lang || "").toLowerCase()] ? lang.toLowerCase() : null);
    if (!fam) return esc(code);
    const kw = sets[fam];
    const comment = HASH_COMMENT.has(fam) ? "#[^\\n]*" : fam === "sql" ? "--[^\\n]*" : fam === "json" ? "(?!)" : "\\/\\/[^\\n]*|\\/\\*[\\s\\S]*?(?:\\*\\/|$)";
    const str = fam === "py" ? "\"\"\"[\\s\\S]*?(?:\"\"\"|$)|'''[\\s\\S]*?(?:'''|$)|" : "";
    const re = new RegExp(`(${comment})|(${str}"(?:\\\\.|[^"\\\\\\n])*"?|'(?:\\\\.|[^'\\\\\\n])*'?|\`(?:\\\\.|[^\`\\\\])*\`?)|(\\b\\d[\\d_]*(?:\\.\\d+)?(?:e[+-]?\\d+)?\\b|\\b0x[\\da-f]+\\b)|([A-Za-z_$][\\w$]*)`, "gi");
    let out = "", last = 0, m;
    while ((m = re.exec(code)) !== null) {
      if (m[0] === "") { re.lastIndex++; continue; }
      out += esc(code.slice(last, m.index));
      const t = esc(m[0]);
      if (m[1]) out += `<span class="tk-c">${t}</span>`;
      else if (m[2]) out += `<span class="tk-s">${t}</span>`;
      else if (m[3]) out += `<span class="tk-n">${t}</span>`;
      else if (kw.has(m[4]) || (fam === "sql" && kw.has(m[4].toLowerCase()))) out += `<span class="tk-k">${t}</span>`;
      else if (code[re.lastIndex] === "(") out += `<span class="tk-f">${t}</span>`;
      else out += t;
      last = re.lastIndex;
    }
    return out + esc(code.slice(last));
  }

  // ---- inline spans: code first (its content is literal), then the rest ----
  function safeUrl(url) {
    const u = url.trim();
    return /^(https?:\/\/|mailto:)/i.test(u) ? u : null;
  }

  function inline(text) {
    const parts = text.split(/(`+)([\s\S]*?[^`])\1(?!`)/);
    let out = "";
    for (let i = 0; i < parts.length; i++) {
      if (i % 3 === 0) out += spans(parts[i]);
      else if (i % 3 === 2) out += `<code>${esc(parts[i].replace(/^ (.*) $/, "$1"))}</code>`;
    }
    return out;
  }

  function spans(raw) {
    // Links are cut out before escaping so the URL can be checked as written. Images become
    // links too: the page never loads anything a model names.
    let out = "", last = 0, m;
    const link = /!?\[([^\]\n]+)\]\(([^)\s]+)\)/g;
    while ((m = link.exec(raw)) !== null) {
      out += emphasis(esc(raw.slice(last, m.index)));
      const url = safeUrl(m[2]);
      out += url ? `<a href="${esc(url)}" target="_blank" rel="noopener noreferrer">${emphasis(esc(m[1]))}</a>`
                 : emphasis(esc(m[0]));
      last = link.lastIndex;
    }
    return out + emphasis(esc(raw.slice(last)));
  }

  function emphasis(s) {  // s is already escaped: these only wrap escaped text in tags
    return s
      .replace(/\*\*(?=\S)([\s\S]*?\S)\*\*/g, "<strong>$1</strong>")
      .replace(/__(?=\S)([\s\S]*?\S)__/g, "<strong>$1</strong>")
      .replace(/(^|[^*\w])\*(?=[^\s*])([^*\n]*?[^\s*])\*(?!\w)/g, "$1<em>$2</em>")
      .replace(/(^|[^_\w])_(?=[^\s_])([^_\n]*?[^\s_])_(?!\w)/g, "$1<em>$2</em>")
      .replace(/~~(?=\S)([\s\S]*?\S)~~/g, "<del>$1</del>");
  }

  // ---- blocks ----
  const FENCE = /^ {0,3}(```+|~~~+)\s*([\w+#.-]*)[^\n]*$/;
  const LIST_ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  const TABLE_SEP = /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/;

  function codeBlock(code, lang) {
    const label = lang ? `<span class="code-lang">${esc(lang)}</span>` : "<span class=\"code-lang\"></span>";
    return `<div class="code"><div class="code-bar">${label}<button type="button" class="copy-code">copy</button></div>` +
           `<pre><code>${highlight(code, lang)}</code></pre></div>`;
  }

  function cells(row) {
    return row.trim().replace(/^\|/, "").replace(/\|$/, "").split("|").map(c => c.trim());
  }

  function list(lines) {
    // lines: [{indent, ordered, text}] -> nested <ul>/<ol>
    let html = "", i = 0;
    function level(indent) {
      const ordered = lines[i].ordered;
      let s = ordered ? "<ol>" : "<ul>";
      while (i < lines.length && lines[i].indent >= indent) {
        if (lines[i].indent > indent) { s = s.replace(/<\/li>$/, "") + level(lines[i].indent) + "</li>"; continue; }
        s += `<li>${inline(lines[i].text)}</li>`;
        i++;
      }
      return s + (ordered ? "</ol>" : "</ul>");
    }
    while (i < lines.length) html += level(lines[i].indent);
    return html;
  }

  function render(src) {
    const lines = src.replace(/\r\n?/g, "\n").split("\n");
    let html = "", para = [];
    const flush = () => { if (para.length) { html += `<p>${inline(para.join("\n")).replace(/\n/g, "<br>")}</p>`; para = []; } };
    for (let i = 0; i < lines.length; i++) {
      const line = lines[i];
      let m;
      if ((m = FENCE.exec(line))) {
        flush();
        const fence = m[1], body = [];
        for (i++; i < lines.length && !(lines[i].trim().startsWith(fence[0].repeat(fence.length)) && lines[i].trim().replace(/[`~]/g, "") === ""); i++) body.push(lines[i]);
        html += codeBlock(body.join("\n"), m[2]);
      } else if (!line.trim()) {
        flush();
      } else if ((m = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/.exec(line))) {
        flush();
        html += `<h${m[1].length}>${inline(m[2])}</h${m[1].length}>`;
      } else if (/^ {0,3}([-*_])(\s*\1){2,}\s*$/.test(line)) {
        flush();
        html += "<hr>";
      } else if (/^ {0,3}>/.test(line)) {
        flush();
        const quote = [];
        for (; i < lines.length && /^ {0,3}>/.test(lines[i]); i++) quote.push(lines[i].replace(/^ {0,3}> ?/, ""));
        i--;
        html += `<blockquote>${render(quote.join("\n"))}</blockquote>`;
      } else if (line.includes("|") && i + 1 < lines.length && TABLE_SEP.test(lines[i + 1])) {
        flush();
        const head = cells(line);
        let t = "<div class=\"table\"><table><thead><tr>" + head.map(c => `<th>${inline(c)}</th>`).join("") + "</tr></thead><tbody>";
        for (i += 2; i < lines.length && lines[i].includes("|") && lines[i].trim(); i++) {
          t += "<tr>" + cells(lines[i]).map(c => `<td>${inline(c)}</td>`).join("") + "</tr>";
        }
        i--;
        html += t + "</tbody></table></div>";
      } else if (LIST_ITEM.test(line)) {
        flush();
        const items = [];
        for (; i < lines.length; i++) {
          const li = LIST_ITEM.exec(lines[i]);
          if (li) items.push({indent: li[1].replace(/\t/g, "    ").length, ordered: /\d/.test(li[2]), text: li[3]});
          else if (lines[i].trim() && /^\s+/.test(lines[i]) && items.length) items[items.length - 1].text += "\n" + lines[i].trim();
          else break;
        }
        i--;
        html += list(items);
      } else {
        para.push(line);
      }
    }
    flush();
    return html;
  }

  return {render, esc, highlight};
})();
