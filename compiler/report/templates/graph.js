// The folding stage graph of the pipecut plan report. Reads the JSON in #graph-data, draws SVG.
// One column per stage; each column is the stage's module tree in topological order, folded
// so that about BUDGET boxes show per stage. Cut edges (between stages) are always drawn and
// labelled; edges inside a stage are drawn for the box under the mouse.
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var COL_W = 260, GAP = 230, ROW_H = 24, INDENT = 12, TOP = 40, BUDGET = 28, CHAR_W = 6.3;
  var data = JSON.parse(document.getElementById("graph-data").textContent);
  var svg = document.getElementById("graph");
  var tip = document.getElementById("tip");
  var groups = {};   // id -> {id, stage, path, parent, children, count, ms}
  var chains = [];   // node index -> group ids from the outermost module inward
  var open = {};     // group id -> true when unfolded

  function hb(n) {
    var units = ["B", "KiB", "MiB", "GiB"], i = 0;
    while (Math.abs(n) >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return i ? n.toFixed(1) + " " + units[i] : n + " B";
  }
  function ms(x) { return (x < 10 ? x.toPrecision(3) : x.toFixed(1)) + " ms"; }
  function el(name, attrs, parent) {
    var e = document.createElementNS(NS, name);
    for (var k in attrs) { e.setAttribute(k, attrs[k]); }
    if (parent) { parent.appendChild(e); }
    return e;
  }
  function fit(text, width) {
    var n = Math.floor((width - 10) / CHAR_W);
    return text.length <= n ? text : text.slice(0, Math.max(n - 1, 1)) + "…";
  }

  // --- the module tree of every stage ---------------------------------------------------------
  data.stages.forEach(function (s) {
    groups[s.index + ":"] = {id: s.index + ":", stage: s.index, path: "", parent: null, children: [], count: 0, ms: 0};
  });
  data.nodes.forEach(function (n, i) {
    var parent = groups[n.stage + ":"], chain = [];
    var parts = n.module ? n.module.split(".") : [];
    for (var k = 1; k <= parts.length; k++) {
      var path = parts.slice(0, k).join("."), id = n.stage + ":" + path;
      if (!groups[id]) {
        groups[id] = {id: id, stage: n.stage, path: path, parent: parent, children: [], count: 0, ms: 0};
        parent.children.push({group: id});
      }
      parent = groups[id];
      chain.push(id);
    }
    parent.children.push({node: i});
    chains.push(chain);
    groups[n.stage + ":"].count++;
    chain.forEach(function (id) { groups[id].count++; groups[id].ms += n.ms; });
  });

  // A module holding a single node is drawn as that node: it is always "open".
  function trivial(id) {
    var c = groups[id].children;
    return c.length === 1 && c[0].node !== undefined;
  }
  function plural(n, word) { return n + " " + word + (n === 1 ? "" : "s"); }

  function rowsOf(stage) {
    var rows = [];
    (function walk(g, depth) {
      g.children.forEach(function (c) {
        if (c.group && trivial(c.group)) {
          walk(groups[c.group], depth);
        } else if (c.group) {
          rows.push({group: c.group, depth: depth});
          if (open[c.group]) { walk(groups[c.group], depth + 1); }
        } else {
          rows.push({node: c.node, depth: depth});
        }
      });
    })(groups[stage + ":"], 0);
    return rows;
  }

  function initialFolding() {
    open = {};
    data.stages.forEach(function (s) {
      var root = groups[s.index + ":"], shown = root.children.length;
      var queue = root.children.filter(function (c) { return c.group; }).map(function (c) { return c.group; });
      while (queue.length) {
        var g = groups[queue.shift()];
        if (trivial(g.id) || shown + g.children.length > BUDGET) { continue; }
        open[g.id] = true;
        shown += g.children.length;
        g.children.forEach(function (c) { if (c.group) { queue.push(c.group); } });
      }
    });
  }

  // The box that shows node i: its outermost folded module, or the node itself.
  function boxOf(i) {
    var chain = chains[i];
    for (var k = 0; k < chain.length; k++) {
      if (!open[chain[k]] && !trivial(chain[k])) { return "g" + chain[k]; }
    }
    return "n" + i;
  }

  function showTip(evt, text) {
    tip.textContent = text;
    tip.hidden = false;
    tip.style.left = Math.min(evt.clientX + 14, window.innerWidth - 440) + "px";
    tip.style.top = (evt.clientY + 14) + "px";
  }

  // --- drawing ----------------------------------------------------------------------------------
  function draw() {
    while (svg.firstChild) { svg.removeChild(svg.firstChild); }
    var pos = {}, maxRows = 0, boxes = 0;
    var back = el("g", {}, svg), edgeLayer = el("g", {}, svg), itemLayer = el("g", {}, svg);
    var hoverLayer = el("g", {}, svg), labelLayer = el("g", {}, svg);
    data.stages.forEach(function (s) {
      var x0 = 10 + s.index * (COL_W + GAP), rows = rowsOf(s.index);
      maxRows = Math.max(maxRows, rows.length);
      boxes += rows.length;
      el("rect", {x: x0 - 6, y: 4, width: COL_W + 12, height: 26, rx: 6, fill: s.colour}, back);
      var title = el("text", {x: x0 + 2, y: 21, "class": "col-title", "data-stage": s.index}, back);
      title.textContent = "stage " + s.index + " · " + s.device + " · " + plural(groups[s.index + ":"].count, "node") + " · " + ms(s.ms);
      rows.forEach(function (r, k) {
        var x = x0 + r.depth * INDENT, y = TOP + k * ROW_H, w = COL_W - r.depth * INDENT;
        var key, label, text;
        var g = el("g", {"class": "item", "data-stage": s.index}, itemLayer);
        if (r.group) {
          var grp = groups[r.group];
          key = "g" + r.group;
          g.setAttribute("class", "item group" + (open[r.group] ? " open" : ""));
          label = (open[r.group] ? "▾ " : "▸ ") + grp.path + " · " + plural(grp.count, "node") + " · " + ms(grp.ms);
          text = "module " + grp.path + " (stage " + s.index + ")\n" + plural(grp.count, "node") + ", " + ms(grp.ms) + " forward+backward\nclick to " + (open[r.group] ? "fold" : "unfold");
          g.addEventListener("click", function () { open[r.group] = !open[r.group]; draw(); });
        } else {
          var n = data.nodes[r.node];
          key = "n" + r.node;
          label = n.name + " · " + ms(n.ms);
          text = n.name + " (" + n.op + " " + n.target + ")\nmodule " + (n.module || "(top level)") + ", stage " + n.stage +
            "\n" + ms(n.ms) + " forward+backward\noutput " + (n.shape ? "[" + n.shape.join(", ") + "] " : "") + (n.dtype || "") + " · " + hb(n.bytes);
        }
        g.setAttribute("data-box", key);
        pos[key] = {x: x, y: y, w: w, stage: s.index, el: g};
        el("rect", {x: x, y: y, width: w, height: ROW_H - 4, rx: 4, fill: s.colour}, g);
        el("text", {x: x + 6, y: y + 14}, g).textContent = fit(label, w);
        g.addEventListener("mouseenter", function (evt) { hover(key, true); showTip(evt, text); });
        g.addEventListener("mousemove", function (evt) { showTip(evt, text); });
        g.addEventListener("mouseleave", function () { hover(key, false); tip.hidden = true; });
      });
    });
    var width = 20 + data.stages.length * (COL_W + GAP) - GAP;
    var height = TOP + Math.max(maxRows, 1) * ROW_H + 10;
    svg.setAttribute("width", width);
    svg.setAttribute("height", height);
    svg.setAttribute("viewBox", "0 0 " + width + " " + height);

    // Aggregate edges between the boxes now shown.
    var cuts = {}, flows = {};
    data.edges.forEach(function (e) {
      var a = boxOf(e[0]), b = boxOf(e[1]);
      if (a === b) { return; }
      var key = a + ">" + b;
      if (pos[a].stage !== pos[b].stage) {
        var c = cuts[key] || (cuts[key] = {a: a, b: b, tensors: {}});
        c.tensors[data.nodes[e[0]].name] = true;
      } else {
        flows[key] = {a: a, b: b};
      }
    });
    var taken = {};  // stage -> y of the cut labels in the gap after it
    Object.keys(cuts).forEach(function (key) {
      var c = cuts[key], p = pos[c.a], q = pos[c.b];
      var x1 = p.x + p.w, y1 = p.y + ROW_H / 2 - 2, x2 = q.x, y2 = q.y + ROW_H / 2 - 2, dx = Math.max((x2 - x1) / 2, 40);
      var names = Object.keys(c.tensors);
      var total = names.reduce(function (t, name) { return t + (data.cuts[name] ? data.cuts[name].bytes : 0); }, 0);
      var label = names.length === 1 && data.cuts[names[0]] ? data.cuts[names[0]].label : names.length + " tensors · " + hb(total);
      var path = el("path", {"class": "cut", d: "M" + x1 + "," + y1 + " C" + (x1 + dx) + "," + y1 + " " + (x2 - dx) + "," + y2 + " " + x2 + "," + y2}, edgeLayer);
      el("title", {}, path).textContent = names.map(function (name) {
        return name + ": " + (data.cuts[name] ? data.cuts[name].label : "");
      }).join("\n");
      // Labels sit right of their source box; one that would overlap another in the same gap
      // moves down a little, or is left out (the curve's tooltip still lists its tensors).
      var used = taken[p.stage] || (taken[p.stage] = []), y = y1 - 4;
      while (used.some(function (u) { return Math.abs(u - y) < 12; }) && y < y1 + 24) { y += 12; }
      if (used.some(function (u) { return Math.abs(u - y) < 12; })) { return; }
      used.push(y);
      var bg = el("rect", {"class": "cut-label-bg"}, labelLayer);
      var t = el("text", {"class": "cut-label", x: x1 + 6, y: y}, labelLayer);
      t.textContent = fit(label, GAP - 10);
      var bb = t.getBBox();
      bg.setAttribute("x", bb.x - 2); bg.setAttribute("y", bb.y);
      bg.setAttribute("width", bb.width + 4); bg.setAttribute("height", bb.height);
    });

    function hover(key, on) {
      pos[key].el.classList.toggle("hot", on);
      while (hoverLayer.firstChild) { hoverLayer.removeChild(hoverLayer.firstChild); }
      if (!on) { return; }
      Object.keys(flows).forEach(function (fk) {
        var f = flows[fk];
        if (f.a !== key && f.b !== key) { return; }
        var p = pos[f.a], q = pos[f.b], xa = p.x + p.w, xb = q.x + q.w;
        var ya = p.y + ROW_H / 2 - 2, yb = q.y + ROW_H / 2 - 2, bulge = 20 + Math.min(Math.abs(yb - ya) / 4, 60);
        el("path", {"class": "flow", d: "M" + xa + "," + ya + " C" + (xa + bulge) + "," + ya + " " + (xb + bulge) + "," + yb + " " + xb + "," + yb}, hoverLayer);
      });
    }
    document.getElementById("graph-count").textContent =
      data.nodes.length + " nodes in " + data.stages.length + " stages, shown as " + boxes + " boxes; " + Object.keys(cuts).length + " cut edges drawn";
  }

  document.getElementById("expand-all").addEventListener("click", function () {
    Object.keys(groups).forEach(function (id) { open[id] = true; }); draw();
  });
  document.getElementById("collapse-all").addEventListener("click", function () { open = {}; draw(); });
  document.getElementById("reset").addEventListener("click", function () { initialFolding(); draw(); });
  initialFolding();
  draw();
})();
