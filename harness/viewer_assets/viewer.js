/* The transcript viewer (harness/viewer.py embeds it in every page it writes): renders the samples of the page's
   #viewer-data JSON one page of cards at a time, filters, searches, and compares two evaluations. */
(function () {
  var D = JSON.parse(document.getElementById("viewer-data").textContent), PAGE = 25;
  var root = document.getElementById("viewer"), $ = function (id) { return document.getElementById(id); };
  var state = {page: 0, matches: [], pairs: []};
  function esc(s) { return String(s).replace(/[&<>"]/g, function (c) { return {"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;"}[c]; }); }
  var KW = /^(def|class|return|if|elif|else|for|while|in|not|and|or|import|from|as|with|try|except|finally|raise|lambda|yield|None|True|False|print|pass|break|continue|is|fi|then|do|done|echo|cd|export|function|const|let|var)$/;
  var TOKEN = /(#[^\n]*)|("{3}[\s\S]*?"{3}|'{3}[\s\S]*?'{3}|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*')|\b(\d+(?:\.\d+)?)\b|\b([A-Za-z_]\w*)\b/g;
  function code(text) {  /* keywords, strings, comments and numbers of Python / shell-like code */
    var out = "", last = 0;
    text.replace(TOKEN, function (m, com, str, num, word, at) {
      out += esc(text.slice(last, at)); last = at + m.length;
      if (com) out += '<span class="com">' + esc(m) + "</span>";
      else if (str) out += '<span class="str">' + esc(m) + "</span>";
      else if (num) out += '<span class="num">' + m + "</span>";
      else out += KW.test(word) ? '<span class="kw">' + m + "</span>" : m;
      return m;
    });
    return out + esc(text.slice(last));
  }
  function diff(text) {
    return text.split("\n").map(function (l) {
      var c = /^(\+\+\+|---)/.test(l) ? "hunk" : l[0] === "+" ? "add" : l[0] === "-" ? "del" : l.slice(0, 2) === "@@" ? "hunk" : "";
      return c ? '<span class="' + c + '">' + esc(l) + "</span>" : esc(l);
    }).join("\n");
  }
  function looksLikeDiff(text) { return /^(diff --git |--- \S)/m.test(text) && /^@@ /m.test(text); }
  var BLOCK = /```(\w*)\n([\s\S]*?)```|<code>([\s\S]*?)<\/code>|<interpreter>([\s\S]*?)<\/interpreter>/g;
  function rich(text) {  /* prose as text; fenced blocks, <code> cells and diffs highlighted */
    if (looksLikeDiff(text) && !/```/.test(text)) return '<pre class="code diff">' + diff(text) + "</pre>";
    var out = "", last = 0;
    text.replace(BLOCK, function (m, lang, fenced, cell, interp, at) {
      out += text.slice(last, at) ? "<pre>" + esc(text.slice(last, at)) + "</pre>" : ""; last = at + m.length;
      var body = fenced !== undefined ? fenced : cell !== undefined ? cell.replace(/^\s*```\w*\n([\s\S]*?)\n?```\s*$/, "$1") : interp;
      var tag = fenced !== undefined ? "```" + lang : cell !== undefined ? "<code>" : "<interpreter>";
      var inner = lang === "diff" || looksLikeDiff(body) ? diff(body) : interp !== undefined ? esc(body) : code(body);
      out += '<pre class="code"><span class="com">' + esc(tag) + "</span>\n" + inner + "</pre>";
      return m;
    });
    var rest = text.slice(last);
    return out + (rest ? "<pre>" + esc(rest) + "</pre>" : "");
  }
  function fold(html, text, label) {  /* long outputs folded: the first lines shown, the rest behind a click */
    var lines = text.split("\n").length;
    if (text.length <= 2000 && lines <= 40) return html;
    return '<details class="long"><summary>' + label + " — " + lines + " lines, " + text.length + " chars (click to unfold)</summary>" + html + "</details>";
  }
  function turn(cls, label, text) {
    return '<div class="turn ' + cls + '"><div class="role">' + esc(label) + "</div>" + fold(rich(text), text, esc(label)) + "</div>";
  }
  function card(s) {
    var ev = D.evals[s.e], prompt = D.prompts[s.e][s.p], n = 0, parts = [];
    parts.push('<header><span class="badge ' + s.st + '">' + s.st + "</span><b>" + esc(s.p) + "</b><span class=muted>sample " + s.i +
      " · score " + (s.sc === null ? "-" : s.sc) + " · " + esc(ev.label) + "</span></header>");
    if (prompt !== undefined) parts.push('<details class="prompt"><summary>prompt</summary>' + turn("prompt", "prompt", prompt) + "</details>");
    s.t.forEach(function (t) {
      if (!t[1]) return;
      parts.push(t[0] === "model" ? turn("model", "model · turn " + (++n), t[1]) : turn("observation", "observation", t[1]));
    });
    Object.keys(s.o).forEach(function (key) {
      var v = s.o[key];
      if (typeof v === "string" && v) parts.push(turn("outcome", "outcome · " + key, v));
      else if (v && typeof v === "object" && !Array.isArray(v)) parts.push(turn("outcome", "outcome · " + key, JSON.stringify(v, null, 1)));
      /* lists (an agent's commands) repeat the model turns */
    });
    parts.push('<div class="grade"><b>answer</b> <code>' + esc(s.x === null ? "-" : s.x) + "</code> · <b>grade</b> " + s.st +
      (s.d ? " · <b>reason</b> " + esc(s.d) : "") + "</div>");
    var keys = Object.keys(s.m);
    if (keys.length) parts.push('<div class="metrics">' + keys.map(function (k) {
      var v = s.m[k]; return "<span>" + esc(k) + " <b>" + esc(typeof v === "number" ? +v.toPrecision(4) : v) + "</b></span>"; }).join("") + "</div>");
    return '<article class="card sample" data-status="' + s.st + '" data-problem="' + esc(s.p) + '">' + parts.join("") + "</article>";
  }
  function haystack(s) {
    if (s._h === undefined) s._h = (s.p + "\n" + s.t.map(function (t) { return t[1]; }).join("\n") + "\n" + s.d + "\n" +
      Object.values(s.o).join("\n") + "\n" + (D.prompts[s.e][s.p] || "")).toLowerCase();
    return s._h;
  }
  function filterSamples() {
    var st = $("v-status").value, task = $("v-task").value, ev = $("v-eval").value, q = $("v-search").value.toLowerCase();
    state.matches = D.samples.filter(function (s) {
      return (st === "all" || s.st === st) && (task === "all" || D.evals[s.e].task === task) && (ev === "all" || String(s.e) === ev) &&
        (!q || haystack(s).indexOf(q) >= 0);
    });
    state.page = 0; show();
  }
  function show() {
    var pages = Math.max(1, Math.ceil(state.matches.length / PAGE));
    state.page = Math.min(Math.max(state.page, 0), pages - 1);
    $("v-count").textContent = state.matches.length + " of " + D.samples.length + " samples · page " + (state.page + 1) + " / " + pages;
    $("v-list").innerHTML = state.matches.slice(state.page * PAGE, (state.page + 1) * PAGE).map(card).join("");
  }
  function problemScores(e, k) {  /* mean score of each problem's first k valid samples (the gate's rule) */
    var acc = {};
    D.samples.forEach(function (s) {
      if (s.e !== e || s.i >= k || s.st === "error" || s.sc === null) return;
      var a = acc[s.p] || (acc[s.p] = [0, 0]); a[0] += s.sc; a[1] += 1;
    });
    var out = {}; Object.keys(acc).forEach(function (p) { out[p] = acc[p][0] / acc[p][1]; }); return out;
  }
  function compare() {
    var b = Number($("v-base").value), c = Number($("v-cand").value), want = $("v-flip").value;
    var k = Math.min(D.evals[b].k || 1e9, D.evals[c].k || 1e9), sb = problemScores(b, k), sc = problemScores(c, k);
    state.pairs = Object.keys(sb).filter(function (p) { return p in sc; }).sort().map(function (p) {
      return {p: p, b: sb[p], c: sc[p], flip: sc[p] < sb[p] ? "pass_to_fail" : sc[p] > sb[p] ? "fail_to_pass" : "same"};
    });
    var counts = {pass_to_fail: 0, fail_to_pass: 0, same: 0};
    state.pairs.forEach(function (x) { counts[x.flip] += 1; });
    $("v-flips").textContent = counts.pass_to_fail + " pass→fail · " + counts.fail_to_pass + " fail→pass · " + counts.same + " unchanged" +
      (D.evals[b].task !== D.evals[c].task ? " (different tasks: problems matched by id)" : "");
    $("v-flips").dataset.passToFail = counts.pass_to_fail; $("v-flips").dataset.failToPass = counts.fail_to_pass;
    var shown = state.pairs.filter(function (x) { return want === "all" || x.flip === want; });
    $("v-pairs").innerHTML = "<table><tr><th>problem</th><th>baseline</th><th>candidate</th><th>change</th></tr>" + shown.slice(0, 500).map(function (x) {
      return '<tr class="flip" data-problem="' + esc(x.p) + '"><td>' + esc(x.p) + '</td><td class="num">' + x.b.toFixed(3) + '</td><td class="num">' +
        x.c.toFixed(3) + "</td><td>" + {pass_to_fail: "pass→fail", fail_to_pass: "fail→pass", same: "="}[x.flip] + "</td></tr>";
    }).join("") + "</table>" + (shown.length > 500 ? "<p class=muted>first 500 of " + shown.length + " (search narrows the list)</p>" : "");
    $("v-side").innerHTML = "";
  }
  function side(problem) {
    var b = Number($("v-base").value), c = Number($("v-cand").value);
    var col = function (e) { return "<div><h4>" + esc(D.evals[e].label) + "</h4>" + D.samples.filter(function (s) { return s.e === e && s.p === problem; })
      .map(card).join("") + "</div>"; };
    $("v-side").innerHTML = '<h3>' + esc(problem) + '</h3><div class="pair">' + col(b) + col(c) + "</div>";
    $("v-side").scrollIntoView();
  }
  var opts = function (values, labels) { return values.map(function (v, i) { return '<option value="' + esc(v) + '">' + esc(labels[i]) + "</option>"; }).join(""); };
  var tasks = Array.from(new Set(D.evals.map(function (e) { return e.task; }))).sort(), idx = D.evals.map(function (e, i) { return String(i); });
  var labels = D.evals.map(function (e) { return e.label + (e.avg === null || e.avg === undefined ? "" : " (Avg@" + e.k + " " + e.avg.toFixed(3) + ")"); });
  root.innerHTML = '<h3>Compare two evaluations</h3><div class="bar">baseline <select id="v-base">' + opts(idx, labels) + '</select> candidate <select id="v-cand">' +
    opts(idx, labels) + '</select> show <select id="v-flip"><option value="pass_to_fail">pass→fail</option><option value="fail_to_pass">fail→pass</option>' +
    '<option value="all">all problems</option></select> <span id="v-flips" class="muted"></span></div><div id="v-pairs"></div><div id="v-side"></div>' +
    '<h3>Samples</h3><div class="bar"><select id="v-status"><option value="all">all grades</option><option value="pass">pass</option>' +
    '<option value="fail">fail</option><option value="error">error</option></select> <select id="v-task"><option value="all">all tasks</option>' + opts(tasks, tasks) +
    '</select> <select id="v-eval"><option value="all">all evaluations</option>' + opts(idx, labels) + '</select> <input id="v-search" type="search" placeholder="search text, ids, reasons" size="30">' +
    ' <button id="v-prev">◀ prev</button><button id="v-next">next ▶</button> <span id="v-count" class="muted"></span></div><div id="v-list"></div>';
  if (D.compare) { $("v-base").value = String(D.compare[0]); $("v-cand").value = String(D.compare[1]); }
  else if (D.evals.length > 1) $("v-cand").value = String(D.evals.length - 1);
  ["v-status", "v-task", "v-eval"].forEach(function (id) { $(id).addEventListener("change", filterSamples); });
  var timer; $("v-search").addEventListener("input", function () { clearTimeout(timer); timer = setTimeout(filterSamples, 150); });
  $("v-prev").addEventListener("click", function () { state.page -= 1; show(); });
  $("v-next").addEventListener("click", function () { state.page += 1; show(); });
  ["v-base", "v-cand", "v-flip"].forEach(function (id) { $(id).addEventListener("change", compare); });
  $("v-pairs").addEventListener("click", function (ev) { var row = ev.target.closest("tr.flip"); if (row) side(row.dataset.problem); });
  window.harnessViewer = {filter: filterSamples, compare: compare, side: side, state: state, data: D};
  if (D.evals.length) { compare(); filterSamples(); } else root.innerHTML = '<p class="muted">no stored samples</p>';
  window.harnessViewer.drawnMs = performance.now();  /* navigation start to the first page of cards drawn */
})();
