// The ring, live: for each model, the chain a pass travels (client -> nodes -> client) and every node with its
// address, key, slice, device, memory, recent pass time, links and state. It is drawn from the service's own status
// stream (GET /ring/events: server-sent events, read with fetch so that the API key goes with it) each time the
// ring changes, without reloading anything; if the stream breaks it is opened again.
"use strict";

const RING_RETRY_MS = 2000;
const STATE_WORDS = {
  serving: "serving", slow: "slow", spare: "spare (a replica, waiting)", ready: "ready", fetching: "fetching its slice",
  dead: "dead (no answer)", replaced: "dead, replaced", unknown: "asking…",
};

function bytes(n) {
  if (n === null || n === undefined) return "?";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let k = 0;
  while (n >= 1024 && k < units.length - 1) { n /= 1024; k += 1; }
  return (k ? n.toFixed(1) : String(n)) + " " + units[k];
}

function ms(x) { return x === null || x === undefined ? "?" : (x < 10 ? x.toFixed(2) : x.toFixed(0)) + " ms"; }

function el(tag, className, text) {
  const e = document.createElement(tag);
  if (className) e.className = className;
  if (text !== undefined) e.textContent = text;
  return e;
}

function nodeCard(n) {
  const card = el("div", "node-card state-" + n.state);
  card.dataset.address = n.address;
  card.dataset.state = n.state;
  card.append(el("div", "state", STATE_WORDS[n.state] || n.state));
  card.append(el("div", "address", n.address));
  if (n.key) card.append(el("div", "key", "key " + n.key + "…"));
  if (n.key_differs) card.append(el("div", "warning", "its status names another key than the one pinned"));
  card.append(el("div", "slices", n.slices.length ? n.slices.join(", ") : "holds what a request asks"));
  if (n.device) card.append(el("div", "device", n.device + (n.dtype ? " · " + n.dtype : "")));
  if (n.memory && n.memory.held !== null) {
    card.append(el("div", "memory", `held ${bytes(n.memory.held)} · free ${bytes(n.memory.free)}`));
  }
  if (n.pass_ms !== null) card.append(el("div", "pass", "pass " + ms(n.pass_ms)));
  if (n.sessions !== null && n.sessions !== undefined) {
    card.append(el("div", "sessions", n.sessions + (n.sessions === 1 ? " session" : " sessions")));
  }
  if (n.replaced_by) card.append(el("div", "replaced-by", "replaced by " + n.replaced_by));
  if (n.fetching) card.append(el("div", "fetching", bytes(n.fetching.bytes_done) + " of " + bytes(n.fetching.bytes_total)));
  if (n.error && n.state !== "replaced") card.title = n.error;
  return card;
}

// An arrow of the chain with its link's round trip: between two nodes as the first measured it at a session's
// open; from and back to the client, the service's own status round trip to that node.
function hop(link, broken, how) {
  const li = el("li", "hop" + (broken ? " broken" : ""), "→ " + (link === null || link === undefined ? "" : ms(link)));
  li.title = how;
  return li;
}

function drawModel(m) {
  const box = el("div", "ring-model");
  box.dataset.model = m.name;
  const title = el("h3", "", m.name + " ");
  title.append(el("span", "muted", m.kind + (m.running ? ` · ${m.running} running` : "")));
  box.append(title);
  const byAddress = Object.fromEntries(m.nodes.map((n) => [n.address, n]));
  if (m.chain.length) {
    const chain = el("ol", "chain");
    chain.setAttribute("aria-label", "the chain a pass travels");
    chain.append(el("li", "end", "client"));
    m.chain.forEach((address, k) => {
      const n = byAddress[address] || { address, state: "unknown", slices: [] };
      const prev = k ? byAddress[m.chain[k - 1]] : null;
      chain.append(hop(m.links[k], n.state === "dead" || (prev && prev.state === "dead"),
        k ? "round trip, as the node before measured it" : "round trip of the service's status request"));
      const li = el("li", "in-chain");
      li.append(nodeCard(n));
      chain.append(li);
    });
    const last = byAddress[m.chain[m.chain.length - 1]];
    chain.append(hop(m.links[m.chain.length], last && last.state === "dead", "round trip of the service's status request"));
    chain.append(el("li", "end", "client"));
    box.append(chain);
  } else {
    box.append(el("div", "muted", "no request yet: the chain is drawn once one runs"));
  }
  const others = m.nodes.filter((n) => !m.chain.includes(n.address));
  if (others.length) {
    const row = el("div", "others");
    row.append(el("span", "muted", m.chain.length ? "besides the chain:" : "nodes:"));
    for (const n of others) row.append(nodeCard(n));
    box.append(row);
  }
  return box;
}

function drawRing(snap) {
  const nodes = snap.models.flatMap((m) => m.nodes);
  const answering = nodes.filter((n) => !["dead", "replaced", "unknown"].includes(n.state)).length;
  $("health").textContent = `${answering} of ${nodes.length} nodes answering`;
  const place = $("ring-models");
  place.replaceChildren(...snap.models.map(drawModel));
  place.dataset.version = snap.version;
  $("ring-status").textContent = "live, asked every " + snap.poll_s + " s";
}

async function watchRing() {
  for (;;) {
    try {
      const r = await api("/ring/events");
      await readEvents(r, drawRing);
      $("ring-status").textContent = "the stream ended; opening it again";
    } catch (e) {
      $("ring-status").textContent = "no view of the ring (" + e.message + "); trying again";
    }
    await new Promise((ok) => setTimeout(ok, RING_RETRY_MS));
  }
}
