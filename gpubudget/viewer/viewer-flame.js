// gpubudget's memory viewer, part 4 of 6: the flame graph (an icicle). The blocks live at the
// chosen moment in the chosen budget (and its descendants), as a tree of their stacks:
// outermost frame at the top, each frame as wide as the bytes allocated under it; with "tags
// first", a level of tags above the frames. It opens below the frames all blocks share.
// Hover: the frame and its bytes; click: zoom into it (click the top row to zoom out). By
// segment: the segments held at the moment, their live blocks and free bytes.
(function () {
  const { formatSize } = GB;
  const ROW = 18, MAX_ROWS = 40;

  function node(name, parent) { return { name, bytes: 0, count: 0, children: new Map(), parent }; }

  GB.flameTree = function (ds, blocks, byTag) {
    const root = node("all", null);
    for (const k of blocks) {
      const size = ds.blocks.size[k];
      let at = root;
      at.bytes += size; at.count++;
      const path = ds.stackText(k);
      const names = (byTag ? [ds.tagText(k) ? "tag " + ds.tagText(k) : "(no tag)"] : []).concat(path.length ? path : ["(no stack)"]);
      for (const name of names) {
        let next = at.children.get(name);
        if (!next) { next = node(name, at); at.children.set(name, next); }
        next.bytes += size; next.count++;
        at = next;
      }
    }
    return root;
  };

  // By segment: the regions held at the moment (a PyTorch segment, a root's reservation), each
  // as wide as its bytes, split into the live blocks in it (by tag, then stack) and its free
  // bytes (a cache's, a reservation's unused part): where memory sits, not who asked.
  GB.segmentTree = function (ds, blocks, t, lane) {
    const root = node("all segments", null), times = ds.times, segments = [];
    for (const [r, addr, size, from, to] of ds.regions) {
      if (lane !== null && r !== ds.budgets[lane].root) continue;
      if (from >= 0 && times[from] > t || to >= 0 && times[to] <= t) continue;
      segments.push([addr, size, node("segment 0x" + addr.toString(16) + " · " + formatSize(size), root)]);
    }
    segments.sort((a, b) => a[0] - b[0]);
    const starts = segments.map(s => s[0]);
    for (const [, size, n] of segments) { root.children.set(n.name, n); n.bytes = size; root.bytes += size; }
    const outside = node("(no segment known)", root);
    for (const k of blocks) {
      const a = ds.blocks.addr[k], size = ds.blocks.size[k], i = GB.upperBound(starts, a) - 1;
      let at = i >= 0 && a < segments[i][0] + segments[i][1] ? segments[i][2] : outside;
      if (at === outside) { if (!outside.bytes) root.children.set(outside.name, outside); outside.bytes += size; root.bytes += size; }
      at.count++; root.count++;
      at.used = (at.used || 0) + size;
      const path = [ds.tagText(k) ? "tag " + ds.tagText(k) : "(no tag)"].concat(ds.stackText(k).length ? ds.stackText(k) : ["(no stack)"]);
      for (const name of path) {
        let next = at.children.get(name);
        if (!next) { next = node(name, at); at.children.set(name, next); }
        next.bytes += size; next.count++;
        at = next;
      }
    }
    for (const [, size, n] of segments) {
      const free = size - (n.used || 0);
      if (free > 0) { const f = node("(free: held, no block)", n); f.bytes = free; n.children.set(f.name, f); }
    }
    return root;
  };

  function colour(name) {  // warm colours, one per file
    const file = name.split(":")[0];
    let hash = 0;
    for (let i = 0; i < file.length; i++) hash = (hash * 31 + file.charCodeAt(i)) | 0;
    const hue = 15 + (Math.abs(hash) % 40), light = 62 + (Math.abs(hash >> 8) % 16);
    return name.startsWith("tag ") ? "hsl(210, 60%, 75%)" : name.startsWith("segment ") ? "hsl(160, 35%, 70%)" : name.startsWith("(") ? "#e4e7ec" : `hsl(${hue}, 80%, ${light}%)`;
  }
  function label(name) {  // "file.py:12 in function" -> "function (file.py:12)"
    const at = name.lastIndexOf(" in ");
    if (at < 0) return name;
    const file = name.slice(0, at), base = file.slice(file.lastIndexOf("/") + 1);
    return name.slice(at + 4) + " (" + base + ")";
  }

  // Where to open: below the frames every live block shares (a runner's, a framework's), at
  // the first frame where the stacks part, so that the rows shown say something.
  GB.flameStart = function (tree) {
    let at = tree;
    while (at.children.size === 1) {
      const only = at.children.values().next().value;
      if (!only.children.size || only.name.startsWith("tag ") || only.name.startsWith("segment ")) break;
      at = only;
    }
    return at;
  };

  GB.drawFlame = function (app) {
    const canvas = app.flameCanvas, ctx = canvas.getContext("2d"), tree = app.flame.focus;
    const ratio = window.devicePixelRatio || 1, width = app.sizes.flame;
    const rows = [];  // [node, depth, x, w]
    (function place(n, depth, x, w) {
      if (depth >= MAX_ROWS || w < 0.5) return;
      rows.push([n, depth, x, w]);
      let at = x;
      for (const child of [...n.children.values()].sort((a, b) => b.bytes - a.bytes)) {
        const cw = n.bytes ? w * child.bytes / n.bytes : 0;
        place(child, depth + 1, at, cw);
        at += cw;
      }
    })(tree, 0, 0, width);
    const depth = rows.reduce((m, r) => Math.max(m, r[1]), 0) + 1, height = Math.max(depth, 1) * ROW;
    canvas.style.height = height + "px";
    canvas.width = Math.round(width * ratio); canvas.height = Math.round(height * ratio);
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    ctx.font = "11px system-ui"; ctx.textBaseline = "middle";
    for (const [n, d, x, w] of rows) {
      ctx.fillStyle = d === 0 ? "#d0d5dd" : colour(n.name);
      ctx.fillRect(x, d * ROW, Math.max(w - 1, 0.5), ROW - 1);
      if (w > 40) {
        ctx.fillStyle = "#1d2330";
        const hidden = d === 0 && n !== app.flame.tree ? GB.flamePath(n).length : 0;
        let text = (d === 0 ? (n === app.flame.tree ? (n.name === "all segments" ? "all segments held" : "all live blocks") : "▲ " + hidden + " frames, to " + label(n.name)) : label(n.name)) +
          " · " + formatSize(n.bytes);
        const room = Math.floor((w - 6) / 6);
        if (text.length > room) text = text.slice(0, Math.max(room - 1, 1)) + "…";
        ctx.fillText(text, x + 3, d * ROW + ROW / 2);
      }
    }
    app.flame.rows = rows;
    return { rows: rows.length, depth, bytes: tree.bytes };
  };

  GB.flameHit = function (app, x, y) {
    const d = Math.floor(y / ROW);
    for (const row of app.flame.rows || []) if (row[1] === d && x >= row[2] && x < row[2] + row[3]) return row[0];
    return null;
  };

  GB.flamePath = function (n) {  // the frames from the top to n
    const names = [];
    for (let at = n; at && at.parent; at = at.parent) names.push(at.name);
    return names.reverse();
  };
})();
