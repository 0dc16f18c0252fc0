// The forkfleet web console (docs/CONSOLE.md): plain JavaScript over the HTTP API
// (/api/v1, docs/HTTP.md), no build step. Pages: forks, a fork (live over SSE), lineage,
// workers. The token comes from the URL's fragment (#token=...) or a prompt, and is kept
// for this tab only (sessionStorage).
"use strict";

const API = "/api/v1";
const ROW = 30; // the branch list's row height, px
const $ = (sel, root = document) => root.querySelector(sel);
const esc = (s) => String(s ?? "").replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
const usd = (v) => (v == null ? "none" : "$" + Number(v).toFixed(4));
const stateOf = (s) => (typeof s === "string" ? s : s && s.state) || "?";

let token = sessionStorage.getItem("forkfleet-token") || "";
// `#token=T` (and `&page=/forks/ID` to open a page): kept, then taken out of the address.
function takeToken() {
  if (!location.hash.startsWith("#token=")) return;
  const q = new URLSearchParams(location.hash.slice(1));
  token = q.get("token") || "";
  sessionStorage.setItem("forkfleet-token", token);
  history.replaceState(null, "", "#" + (q.get("page") || "/forks"));
}
takeToken();

// ---- the API ---------------------------------------------------------------------------

// A stream of Server-Sent Events. An EventSource cannot send the token in a header, and a
// token never goes in a URL: it asks for a ticket that admits the stream for a minute,
// and opens the stream again with a new one when the server has closed it (a ticket too
// old for a reconnection, a restart). `listen(source)` adds the event listeners;
// `failed()` returns "close" to stop for good.
function openStream(path, listen, failed) {
  let src = null;
  let closed = false;
  const open = async () => {
    if (closed) return;
    let t;
    try {
      t = await call("POST", "/stream-tickets");
    } catch (e) {
      setTimeout(open, 2000);
      return;
    }
    if (closed) return;
    src = new EventSource(`${API}${path}?ticket=${encodeURIComponent(t.ticket)}`);
    listen(src);
    src.onerror = () => {
      if (failed() === "close") {
        closed = true;
        src.close();
      } else if (src.readyState === EventSource.CLOSED) {
        setTimeout(open, 1000);
      }
    };
  };
  open();
  return { close: () => { closed = true; if (src) src.close(); } };
}

async function call(method, path, body) {
  const opts = { method, headers: { Authorization: "Bearer " + token } };
  if (body !== undefined) {
    opts.headers["content-type"] = "application/json";
    opts.body = JSON.stringify(body);
  }
  let r;
  try {
    r = await fetch(API + path, opts);
  } catch (e) {
    setConn(false);
    throw new Error("the server cannot be reached: " + e.message);
  }
  setConn(true);
  if (r.status === 401) {
    askToken();
    throw new Error("a token is needed");
  }
  const ct = r.headers.get("content-type") || "";
  if (!r.ok) {
    const p = ct.includes("json") ? await r.json() : { detail: await r.text() };
    throw new Error(p.detail || p.title || r.statusText);
  }
  if (ct.includes("json")) return r.json();
  return r;
}

async function blobText(hash) {
  if (!hash) return "";
  const r = await call("GET", "/blobs/" + hash);
  return r.text();
}

function setConn(ok) {
  const c = $("#conn");
  c.textContent = ok ? "connected" : "connection lost: retrying";
  c.className = ok ? "conn" : "conn lost";
}

function toast(text, bad) {
  const t = $("#toast");
  t.textContent = text;
  t.className = bad ? "toast bad" : "toast";
  clearTimeout(toast.timer);
  toast.timer = setTimeout(() => (t.className = "toast hidden"), 5000);
}

function modal(html) {
  $("#modal-body").innerHTML = html;
  $("#modal").className = "modal";
}
function closeModal() {
  $("#modal").className = "modal hidden";
}
$("#modal").addEventListener("click", (e) => {
  if (e.target.id === "modal" || e.target.dataset.close !== undefined) closeModal();
});

function askToken() {
  modal(`<h2>Token</h2><p class="dim">The API needs a bearer token (forkfleet ui prints one; a coordinator's come from <code>forkfleet cluster token</code>).</p>
    <div class="row"><input id="tok" size="70" placeholder="ff_..."><button class="primary" id="tok-ok">Use it</button></div>`);
  $("#tok-ok").onclick = () => {
    token = $("#tok").value.trim();
    sessionStorage.setItem("forkfleet-token", token);
    closeModal();
    route();
  };
}

// ---- routing ---------------------------------------------------------------------------

let page = null; // the current page's cleanup
window.addEventListener("hashchange", route);

function route() {
  takeToken();
  if (page && page.close) page.close();
  page = null;
  const h = location.hash.replace(/^#\/?/, "");
  const parts = h.split("/");
  const main = $("#main");
  if (parts[0] === "forks" && parts[1]) page = forkPage(main, parts[1]);
  else if (parts[0] === "runs") page = lineagePage(main);
  else if (parts[0] === "workers") page = workersPage(main);
  else page = forksPage(main);
}

// ---- forks -----------------------------------------------------------------------------

function forksPage(main) {
  main.innerHTML = `<h1>Forks</h1><div class="row"><input id="f-q" placeholder="filter by name, goal or id">
    <select id="f-state"><option value="">every state</option><option>open</option><option>settled</option><option>merged</option><option>aborted</option></select></div>
    <div id="f-list" class="card">loading…</div>`;
  let forks = [];
  const draw = () => {
    const q = $("#f-q").value.toLowerCase();
    const st = $("#f-state").value;
    const rows = forks
      .filter((f) => !st || stateOf(f.state) === st)
      .filter((f) => !q || [f.name, f.goal, f.fork_id].some((s) => (s || "").toLowerCase().includes(q)));
    $("#f-list").innerHTML = rows.length
      ? `<table><tr><th>fork</th><th>name</th><th>state</th><th>branches</th><th>spent</th><th>created</th><th>goal</th></tr>` +
        rows.map((f) => `<tr><td><a href="#/forks/${f.fork_id}">${f.fork_id.slice(0, 13)}</a></td><td>${esc(f.name || "")}</td>
          <td><span class="badge ${stateOf(f.state)}">${stateOf(f.state)}${f.state.winner ? " (" + esc(f.state.winner) + ")" : ""}</span></td>
          <td>${f.branches.length}</td><td>${usd(f.branches.reduce((a, b) => a + b.cost_usd, 0))}</td>
          <td class="dim">${new Date(f.created_at_ms).toLocaleString()}</td><td>${esc((f.goal || "").slice(0, 80))}</td></tr>`).join("") + `</table>`
      : `<p class="dim">No forks${forks.length ? " match" : " yet: forkfleet run, or POST /api/v1/forks"}.</p>`;
  };
  const load = async () => {
    try {
      forks = await call("GET", "/forks");
      draw();
    } catch (e) {
      $("#f-list").textContent = e.message;
    }
  };
  $("#f-q").oninput = draw;
  $("#f-state").onchange = draw;
  load();
  const timer = setInterval(load, 3000);
  return { close: () => clearInterval(timer) };
}

// ---- a fork ----------------------------------------------------------------------------

function forkPage(main, id) {
  const s = { view: null, cost: null, diff: null, verdict: null, points: [], changes: "", closed: false, diffTimer: null };
  main.innerHTML = `<div id="fk-head" class="card">loading…</div>
    <div class="row"><canvas id="fk-chart" width="560" height="140"></canvas><div id="fk-approvals"></div></div>
    <h2>Branches</h2>
    <div class="row"><select id="b-state"><option value="">every state</option></select>
      <input id="b-label" placeholder="label contains"><select id="b-sort"><option value="index">in order</option><option value="cost">by cost</option><option value="turns">by turns</option><option value="label">by label</option></select>
      <span id="b-count" class="dim"></span></div>
    <div id="b-list" class="vlist"><div class="vrow head"><span></span><span>branch</span><span>state</span><span>turns</span><span>spent / cap</span><span>files</span><span>last answer</span></div><div class="spacer" id="b-spacer"></div></div>
    <h2>Diff</h2><div id="fk-diff" class="card dim">…</div>
    <h2>Resolve</h2><div id="fk-verdict" class="card dim">Not resolved yet.</div>`;
  let rows = [];
  const list = $("#b-list");
  const drawRows = () => {
    const top = list.scrollTop;
    const first = Math.max(0, Math.floor(top / ROW) - 5);
    const last = Math.min(rows.length, first + Math.ceil(list.clientHeight / ROW) + 10);
    const caps = new Map(((s.cost && s.cost.branches) || []).map((c) => [c.label, c]));
    const files = filesPerBranch(s.diff);
    let html = "";
    for (let i = first; i < last; i++) {
      const b = rows[i];
      const c = caps.get(b.label);
      html += `<div class="vrow" data-label="${esc(b.label)}" style="top:${i * ROW}px">
        <span>${b.index + 1}</span><span>${esc(b.label)}</span><span><span class="badge ${b.state}">${b.state}</span></span>
        <span>${b.turns}</span><span>${spendBar(b.cost_usd, c && c.cap_usd)}</span>
        <span>${files.get(b.label) ?? ""}</span><span class="dim">${esc((b.last_message_preview || b.error || "").slice(0, 90))}</span></div>`;
    }
    $("#b-spacer").style.height = rows.length * ROW + "px";
    $("#b-spacer").innerHTML = html;
  };
  const filterRows = () => {
    if (!s.view) return;
    const st = $("#b-state").value;
    const q = $("#b-label").value.toLowerCase();
    const sort = $("#b-sort").value;
    rows = s.view.branches.map((b, index) => ({ ...b, index })).filter((b) => (!st || b.state === st) && (!q || b.label.toLowerCase().includes(q)));
    if (sort === "cost") rows.sort((a, b) => b.cost_usd - a.cost_usd);
    if (sort === "turns") rows.sort((a, b) => b.turns - a.turns);
    if (sort === "label") rows.sort((a, b) => a.label.localeCompare(b.label));
    $("#b-count").textContent = `${rows.length} of ${s.view.branches.length}`;
    drawRows();
  };
  let frame = 0;
  list.addEventListener("scroll", () => {
    cancelAnimationFrame(frame);
    frame = requestAnimationFrame(drawRows);
  });
  $("#b-state").onchange = filterRows;
  $("#b-label").oninput = filterRows;
  $("#b-sort").onchange = filterRows;
  list.addEventListener("click", (e) => {
    const r = e.target.closest(".vrow[data-label]");
    if (r) branchPanel(s, r.dataset.label);
  });

  const head = () => {
    const v = s.view;
    const total = v.branches.reduce((a, b) => a + b.cost_usd, 0);
    const cap = s.cost && s.cost.cap_usd;
    const acc = s.cost && s.cost.account;
    const state = stateOf(v.state);
    $("#fk-head").innerHTML = `<h1>${esc(v.name || "fork " + v.fork_id)}</h1>
      <div class="dim">${esc(v.goal)}</div>
      <div class="row" style="margin-top:8px"><span class="badge ${state}">${state}${v.state.winner ? ": " + esc(v.state.winner) : ""}</span>
        <span>fork ${spendBar(total, cap, true)} ${usd(total)}${cap != null ? " of " + usd(cap) : ""}</span>
        ${acc ? `<span>account ${esc(acc.name)} ${spendBar(acc.spent_usd, acc.cap_usd, true)} ${usd(acc.spent_usd)}${acc.cap_usd != null ? " of " + usd(acc.cap_usd) : ""}</span>` : ""}
        <span class="dim">workspace ${esc(v.workspace || "")}</span></div>
      <div class="row" style="margin-top:8px">
        <button id="a-resolve">Resolve</button><button id="a-move">Move budget…</button><button id="a-topup">Top up fork…</button>
        <button class="danger" id="a-abort">Abort</button></div>`;
    $("#a-resolve").onclick = () => act("resolving", () => call("POST", `/forks/${id}/resolve`, {}).then((r) => { s.verdict = r; drawVerdict(s); return "resolved: " + decisionText(r.decision); }));
    $("#a-abort").onclick = () => confirm("Abort the whole fork? Finished work stays in the store.") && act("aborting", () => call("POST", `/forks/${id}/abort`).then(() => "aborted"));
    $("#a-topup").onclick = () => { const v = prompt("Raise the fork's cap by (USD):"); if (v) act("topping up", () => call("POST", `/forks/${id}/topup`, { branch: null, usd: Number(v) }).then(() => "topped up")); };
    $("#a-move").onclick = () => moveBudget(s);
    const states = [...new Set(v.branches.map((b) => b.state))];
    const sel = $("#b-state");
    const cur = sel.value;
    sel.innerHTML = `<option value="">every state</option>` + states.map((x) => `<option ${x === cur ? "selected" : ""}>${x}</option>`).join("");
    drawApprovals(s);
  };

  const refreshDiff = async () => {
    try {
      s.diff = await call("GET", `/forks/${id}/diff`);
      drawDiff(s);
      drawRows();
    } catch (e) {
      $("#fk-diff").textContent = e.message;
    }
  };

  const onView = (data) => {
    s.view = data.view;
    s.cost = data.cost;
    s.points.push([Date.now(), s.view.branches.reduce((a, b) => a + b.cost_usd, 0)]);
    head();
    filterRows();
    drawChart(s);
    const changes = s.view.branches.map((b) => b.changes).join(",");
    if (changes !== s.changes) {
      s.changes = changes;
      clearTimeout(s.diffTimer);
      s.diffTimer = setTimeout(refreshDiff, 300);
    }
  };

  // The first view at once, then live.
  call("GET", `/forks/${id}`).then(async (view) => {
    const cost = await call("GET", `/forks/${id}/cost`).catch(() => null);
    // The stream's first event may have come first: the deltas after it are of it.
    if (!s.streamed) onView({ view, cost });
    const verdict = await call("GET", `/forks/${id}/verdict`).catch(() => null);
    if (verdict) { s.verdict = verdict; drawVerdict(s); }
  }).catch((e) => ($("#fk-head").textContent = e.message));
  const es = openStream(
    `/forks/${id}/stream`,
    (src) => {
      src.addEventListener("fork", (e) => { setConn(true); s.streamed = true; onView(JSON.parse(e.data)); });
      // After its first event a connection sends what changed (rows of 1,000 branches
      // are not sent whole on every change).
      src.addEventListener("delta", (e) => {
        setConn(true);
        const d = JSON.parse(e.data);
        if (!s.view) return;
        patch(s.view, d.view);
        if (s.cost) patch(s.cost, d.cost);
        else if (d.cost && Object.keys(d.cost).length) s.cost = d.cost;
        onView({ view: s.view, cost: s.cost });
      });
    },
    () => (s.view && ["merged", "aborted"].includes(stateOf(s.view.state)) ? "close" : setConn(false)),
  );
  page = { close: () => { es.close(); s.closed = true; } };
  return page;
}

// A fork stream's `delta` applied to what it is of: each key replaced, and of a
// `branches` object the rows by position (a list replaces the whole list).
function patch(target, d) {
  for (const [k, v] of Object.entries(d || {})) {
    if (k === "branches" && v && !Array.isArray(v) && Array.isArray(target.branches)) {
      for (const [i, row] of Object.entries(v)) target.branches[Number(i)] = row;
    } else {
      target[k] = v;
    }
  }
}

function spendBar(spent, cap, wide) {
  if (cap == null) return wide ? `<span class="dim">no cap</span>` : usd(spent);
  const pct = Math.min(100, (100 * spent) / Math.max(cap, 1e-12));
  return `<span class="bar ${wide ? "wide" : ""} ${spent >= cap ? "over" : ""}" title="${usd(spent)} of ${usd(cap)}"><span style="width:${pct}%"></span></span> ${wide ? "" : usd(spent) + " / " + usd(cap)}`;
}

function filesPerBranch(diff) {
  const m = new Map();
  if (!diff) return m;
  for (const l of diff.branches) m.set(l, 0);
  for (const p of diff.paths) for (const c of p.changes) m.set(c.branch, (m.get(c.branch) || 0) + 1);
  return m;
}

function drawChart(s) {
  const c = $("#fk-chart");
  if (!c) return;
  const g = c.getContext("2d");
  g.clearRect(0, 0, c.width, c.height);
  g.fillStyle = "#6b6f76";
  g.font = "11px system-ui";
  g.fillText("spend over time", 8, 14);
  const pts = s.points;
  if (pts.length < 2) return;
  const t0 = pts[0][0], t1 = pts[pts.length - 1][0] || t0 + 1;
  const cap = s.cost && s.cost.cap_usd;
  const max = Math.max(cap || 0, ...pts.map((p) => p[1]), 1e-9);
  const x = (t) => 10 + ((t - t0) / Math.max(t1 - t0, 1)) * (c.width - 90);
  const y = (v) => c.height - 16 - (v / max) * (c.height - 34);
  if (cap) {
    g.strokeStyle = "#d64545";
    g.beginPath(); g.moveTo(10, y(cap)); g.lineTo(c.width - 80, y(cap)); g.stroke();
    g.fillText("cap " + usd(cap), c.width - 90, y(cap) - 3);
  }
  g.strokeStyle = "#2f6fed";
  g.beginPath();
  pts.forEach(([t, v], i) => (i ? g.lineTo(x(t), y(v)) : g.moveTo(x(t), y(v))));
  g.stroke();
  g.fillText(usd(pts[pts.length - 1][1]), c.width - 70, Math.max(26, y(pts[pts.length - 1][1]) - 4));
}

function drawApprovals(s) {
  const waiting = s.view.branches.filter((b) => b.state === "awaiting_approval" && b.approval);
  const el = $("#fk-approvals");
  if (!waiting.length) { el.innerHTML = ""; return; }
  el.innerHTML = `<div class="card"><b>Waiting for your answer</b>` + waiting.map((b) => `<div class="row" data-label="${esc(b.label)}" data-call="${esc(b.approval.call_id)}">
      <span><b>${esc(b.label)}</b> asks to run <code>${esc(b.approval.tool)}</code> <span class="dim">${esc(JSON.stringify(b.approval.args).slice(0, 80))} (rule ${esc(b.approval.rule)})</span></span>
      <button class="primary" data-approve>Approve</button><input placeholder="reason" data-reason><button class="danger" data-deny>Deny</button></div>`).join("") + `</div>`;
  el.querySelectorAll("[data-approve],[data-deny]").forEach((btn) => (btn.onclick = () => {
    const r = btn.closest("[data-label]");
    const approve = btn.dataset.approve !== undefined;
    const reason = $("[data-reason]", r).value.trim() || null;
    act(approve ? "approving" : "denying", () => call("POST", `/forks/${s.view.fork_id}/branches/${encodeURIComponent(r.dataset.label)}/decide`, { call_id: r.dataset.call, approve, reason }).then(() => (approve ? "approved" : "denied")));
  }));
}

function drawDiff(s) {
  const d = s.diff;
  const el = $("#fk-diff");
  if (!d || !d.paths.length) { el.innerHTML = `<span class="dim">No branch changed anything yet.</span>`; return; }
  const labels = d.branches.slice(0, 40);
  el.className = "card";
  el.innerHTML = `<div class="legend"><span class="cell unique">unique</span><span class="cell unanimous_change">unanimous</span><span class="cell split">split</span>
      <span class="dim">${d.summary.total_paths_touched} paths · agreement ${d.summary.agreement_score.toFixed(2)}${d.branches.length > labels.length ? ` · the first ${labels.length} of ${d.branches.length} branches` : ""} · click a cell to compare</span></div>
    <div style="overflow:auto;max-height:360px"><table class="matrix"><tr><th>path</th>${labels.map((l) => `<th>${esc(l)}</th>`).join("")}</tr>` +
    d.paths.map((p) => `<tr><td>${esc(p.path)}</td>` + labels.map((l) => {
      const op = p.operations[l];
      return `<td class="cell ${op && op !== "untouched" ? p.agreement : ""}" data-path="${esc(p.path)}" data-branch="${esc(l)}">${op && op !== "untouched" ? op[0].toUpperCase() : ""}</td>`;
    }).join("") + `</tr>`).join("") + `</table></div>`;
  el.querySelectorAll("td.cell").forEach((td) => (td.onclick = () => compare(s, td.dataset.path, td.dataset.branch)));
}

// A path side by side: the parent's file and two branches' (a line diff against the parent).
async function compare(s, path, first) {
  const p = s.diff.paths.find((x) => x.path === path);
  const touched = p.changes.map((c) => c.branch);
  const other = touched.find((b) => b !== first) || s.diff.branches.find((b) => b !== first) || first;
  const pick = (sel) => `<select data-side="${sel}">` + s.diff.branches.map((b) => `<option ${b === (sel === "a" ? first : other) ? "selected" : ""}>${esc(b)}</option>`).join("") + `</select>`;
  modal(`<div class="row"><h2 style="margin:0">${esc(path)}</h2><span>parent · ${pick("a")} · ${pick("b")}</span><button data-close style="margin-left:auto">Close</button></div>
    <div id="sbs" class="sbs" style="grid-template-columns:1fr 1fr 1fr;margin-top:8px">loading…</div>`);
  const draw = async () => {
    const a = $('[data-side="a"]').value, b = $('[data-side="b"]').value;
    const parent = p.parent ? await blobText(p.parent.hash) : "";
    const side = async (label) => {
      const c = p.changes.find((x) => x.branch === label);
      if (!c) return { text: parent, note: "untouched" };
      if (!c.entry) return { text: "", note: "deleted" };
      return { text: await blobText(c.entry.hash), note: c.operation };
    };
    const [sa, sb] = await Promise.all([side(a), side(b)]);
    $("#sbs").innerHTML = [["parent", { text: parent, note: p.parent ? "" : "absent" }], [a, sa], [b, sb]]
      .map(([name, v], i) => `<div><b>${esc(name)}</b> <span class="dim">${esc(v.note)}</span><pre>${i ? lineDiff(parent, v.text) : esc(v.text)}</pre></div>`).join("");
  };
  document.querySelectorAll("[data-side]").forEach((x) => (x.onchange = draw));
  draw().catch((e) => ($("#sbs").textContent = e.message));
}

// `after`'s lines, those not in `before` marked added, with `before`'s removed lines shown.
function lineDiff(before, after) {
  const a = before.split("\n"), b = after.split("\n");
  const n = a.length, m = b.length;
  if (n * m > 4e6) return esc(after);
  const L = Array.from({ length: n + 1 }, () => new Int32Array(m + 1));
  for (let i = n - 1; i >= 0; i--) for (let j = m - 1; j >= 0; j--) L[i][j] = a[i] === b[j] ? L[i + 1][j + 1] + 1 : Math.max(L[i + 1][j], L[i][j + 1]);
  let i = 0, j = 0, out = "";
  while (i < n || j < m) {
    if (i < n && j < m && a[i] === b[j]) { out += esc(b[j]) + "\n"; i++; j++; }
    else if (j < m && (i >= n || L[i][j + 1] >= L[i + 1][j])) { out += `<span class="l-add">+ ${esc(b[j])}</span>`; j++; }
    else { out += `<span class="l-del">- ${esc(a[i])}</span>`; i++; }
  }
  return out;
}

function decisionText(d) {
  if (!d) return "";
  if (d.kind === "commit") return `merge ${d.winner} (confidence ${d.confidence.toFixed(2)})`;
  if (d.kind === "defer") return `suggests ${d.pick} (confidence ${d.confidence.toFixed(2)}), below the threshold`;
  return "a person picks (no verdict, or manual)";
}

function drawVerdict(s) {
  const r = s.verdict;
  const el = $("#fk-verdict");
  if (!r || !el) return;
  el.className = "card";
  el.innerHTML = `<div><b>Decision:</b> ${esc(decisionText(r.decision))} <span class="dim">(${esc(r.strategy.kind)}, agreement ${Number(r.agreement_score).toFixed(2)}, judges ${usd(r.judge_cost_usd)})</span></div>` +
    (r.tests.length ? `<h2>Tests</h2><table><tr><th>branch</th><th>outcome</th><th>signal</th><th>ms</th><th>worker</th></tr>` + r.tests.map((t) => `<tr><td>${esc(t.label)}</td><td>${esc(JSON.stringify(t.outcome).slice(0, 80))}</td><td>${esc(JSON.stringify(t.signal).slice(0, 80))}</td><td>${t.duration_ms}</td><td class="dim">${esc(t.worker)}</td></tr>`).join("") + `</table>` : "") +
    `<h2>Judges</h2>` + r.judges.map((j) => `<div class="card"><b>${esc(j.run.model)}</b>: ${j.run.verdict ? `picks <b>${esc(j.run.verdict.winner)}</b> at ${j.run.verdict.confidence} · effective ${j.confidence == null ? "?" : j.confidence.toFixed(2)}<div>${esc(j.run.verdict.reasoning)}</div>` : `<span class="dim">${esc(j.run.error || "no verdict")}</span>`}</div>`).join("");
}

function moveBudget(s) {
  const opts = s.view.branches.map((b) => `<option>${esc(b.label)}</option>`).join("");
  modal(`<h2>Move budget</h2><div class="row">from <select id="mv-from">${opts}</select> to <select id="mv-to">${opts}</select> USD <input id="mv-usd" size="8"><button class="primary" id="mv-ok">Move</button><button data-close>Cancel</button></div>`);
  $("#mv-ok").onclick = () => act("moving budget", () => call("POST", `/forks/${s.view.fork_id}/move-budget`, { from: $("#mv-from").value, to: $("#mv-to").value, usd: Number($("#mv-usd").value) }).then(() => "moved")).then(closeModal);
}

// One branch: its conversation and tool calls, and what can be done with it.
async function branchPanel(s, label) {
  const b = s.view.branches.find((x) => x.label === label);
  const fork = s.view.fork_id;
  const base = `/forks/${fork}/branches/${encodeURIComponent(label)}`;
  modal(`<div class="row"><h2 style="margin:0">branch ${esc(label)}</h2><span class="badge ${b.state}">${b.state}</span><span class="dim">${b.turns} turns · ${usd(b.cost_usd)}</span><button data-close style="margin-left:auto">Close</button></div>
    <div class="row" style="margin:8px 0"><input id="bp-text" size="60" placeholder="a message: steers it while it runs, a new turn after"><button id="bp-send" class="primary">Send</button>
      <button id="bp-stop" class="danger">Terminate</button><button id="bp-topup">Top up…</button><button id="bp-merge" class="primary">Merge…</button></div>
    <div id="bp-conv" class="conv">loading…</div>`);
  $("#bp-send").onclick = () => {
    const text = $("#bp-text").value.trim();
    if (!text) return;
    const finished = ["done", "failed", "terminated"].includes(b.state);
    act(finished ? "continuing" : "steering", () => call("POST", `${base}/${finished ? "continue" : "steer"}`, { text }).then(() => (finished ? "a new turn starts" : "steered")));
  };
  $("#bp-stop").onclick = () => confirm(`Terminate ${label}? Its work stays mergeable.`) && act("terminating", () => call("POST", `${base}/terminate`).then(() => "terminated"));
  $("#bp-topup").onclick = () => { const v = prompt(`Raise ${label}'s cap by (USD):`); if (v) act("topping up", () => call("POST", `/forks/${fork}/topup`, { branch: label, usd: Number(v) }).then(() => "topped up")); };
  $("#bp-merge").onclick = () => mergePreview(s, label);
  try {
    const events = await call("GET", `/runs/${b.run_id}/events`);
    const start = events.findIndex((e) => e.event.type === "steer");
    $("#bp-conv").innerHTML = events.slice(Math.max(0, start)).map((e) => eventHtml(e.event)).join("") || `<span class="dim">Nothing yet.</span>`;
  } catch (e) {
    $("#bp-conv").textContent = e.message;
  }
}

function eventHtml(e) {
  switch (e.type) {
    case "user_message": case "follow_up": return `<div class="msg user">${esc(e.text)}</div>`;
    case "steer": return `<div class="msg user"><span class="dim">steer</span> ${esc(e.text)}</div>`;
    case "model_response": return (e.text ? `<div class="msg model">${esc(e.text)}</div>` : "") + e.tool_calls.map((c) => `<div class="msg tool">⚙ ${esc(c.name)} ${esc(JSON.stringify(c.args).slice(0, 300))}</div>`).join("");
    case "tool_result": return `<div class="msg tool">↳ ${esc(e.name)} ${e.ok ? "ok" : "error"}: ${esc(e.output.slice(0, 400))}</div>`;
    case "branch_summary": return `<div class="msg model dim">${esc(e.text)}</div>`;
    case "approval_requested": return `<div class="msg tool">? asks to run ${esc(e.tool)} (rule ${esc(e.rule)})</div>`;
    case "approval_decided": return `<div class="msg tool">${e.approved ? "approved" : "denied"} by ${esc(e.by)}${e.reason ? ": " + esc(e.reason) : ""}</div>`;
    case "status": return e.error ? `<div class="msg tool">${esc(e.state)}: ${esc(e.error)}</div>` : "";
    default: return "";
  }
}

// Merge with a preview of what applying the branch would change.
async function mergePreview(s, label) {
  const fork = s.view.fork_id;
  modal(`<div class="row"><h2 style="margin:0">Merge ${esc(label)}?</h2><button data-close style="margin-left:auto">Cancel</button></div><div id="mp" class="dim">loading the preview…</div>`);
  try {
    const d = await call("GET", `/forks/${fork}/diff?options=${encodeURIComponent(JSON.stringify({ unified: true }))}`);
    const mine = d.paths.filter((p) => p.changes.some((c) => c.branch === label));
    $("#mp").className = "";
    $("#mp").innerHTML = `<p>Applying <b>${esc(label)}</b> changes ${mine.length} path(s):</p>` +
      mine.map((p) => { const c = p.changes.find((x) => x.branch === label); return `<h2>${esc(p.path)} <span class="dim">${c.operation}</span></h2><pre class="sbs" style="white-space:pre-wrap;font:12px ui-monospace,monospace">${esc(c.diff || "")}</pre>`; }).join("") +
      `<button class="primary" id="mp-ok">Merge ${esc(label)}</button>`;
    $("#mp-ok").onclick = () => act("merging", () => call("POST", `/forks/${fork}/merge`, { pick: label }).then((o) => `merged ${o.winner}: ${o.report.applied_paths.length} path(s) applied`)).then(closeModal);
  } catch (e) {
    $("#mp").textContent = e.message;
  }
}

// Run an action, say how it went.
async function act(what, f) {
  try {
    toast(what + "…");
    const msg = await f();
    toast(msg);
  } catch (e) {
    toast(what + " failed: " + e.message, true);
  }
}

// ---- lineage and workers ---------------------------------------------------------------

function lineagePage(main) {
  main.innerHTML = `<h1>Lineage</h1><p class="dim">Every run and where it came from: forks of forks, checkpoint forks, children of runs fork; a winner is marked ★.</p><div id="tree" class="card">loading…</div>`;
  Promise.all([call("GET", "/runs"), call("GET", "/forks")]).then(([runs, forks]) => {
    const winners = new Set();
    for (const f of forks) if (f.state.winner) for (const b of f.branches) if (b.label === f.state.winner) winners.add(b.run_id);
    const kids = new Map();
    for (const r of runs) {
      const p = r.parent || "";
      if (!kids.has(p)) kids.set(p, []);
      kids.get(p).push(r);
    }
    const node = (r) => `<li><span class="badge ${r.state || ""}">${esc(r.kind)}</span> ${winners.has(r.run_id) ? "★ " : ""}<b>${esc(r.label || r.run_id.slice(0, 13))}</b>
      ${r.fork_id ? `<a href="#/forks/${r.fork_id}">fork ${r.fork_id.slice(0, 13)}</a>` : ""} <span class="dim">${r.state || ""} · ${usd(r.cost_usd)}${r.origin ? " · from a checkpoint" : ""}</span>
      ${(kids.get(r.run_id) || []).length ? `<ul>${kids.get(r.run_id).map(node).join("")}</ul>` : ""}</li>`;
    $("#tree").innerHTML = `<ul>${(kids.get("") || []).map(node).join("")}</ul>`;
  }).catch((e) => ($("#tree").textContent = e.message));
  return null;
}

function workersPage(main) {
  main.innerHTML = `<h1>Workers</h1><div id="w" class="card">loading…</div>`;
  const load = () => call("GET", "/workers").then((ws) => {
    $("#w").innerHTML = ws.length ? `<table><tr><th>worker</th><th>pool</th><th>host</th><th>running</th><th>slots</th><th>heartbeat</th></tr>` +
      ws.map((w) => `<tr><td>${esc(String(w.worker_id).slice(0, 13))}</td><td>${esc(w.pool)}</td><td>${esc(w.hostname)}</td><td>${w.running.map((r) => esc(r.slice(0, 13))).join(", ") || "-"}</td><td>${w.concurrency}</td><td class="dim">${Math.round((Date.now() - w.heartbeat_at_ms) / 1000)} s ago</td></tr>`).join("") + `</table>` : `<p class="dim">No live worker.</p>`;
  }).catch((e) => ($("#w").textContent = e.message));
  load();
  const t = setInterval(load, 3000);
  return { close: () => clearInterval(t) };
}

if (!token) askToken();
route();
