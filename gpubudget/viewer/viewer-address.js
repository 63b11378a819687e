// gpubudget's memory viewer, part 3 of 6: the address view. Where a root's blocks sit in its
// memory over time: time across (the lanes' axis), addresses up from the root's base. The
// root's memory (its reservation; a PyTorch device's segments, packed with a gap between
// ranges that do not touch) is grey while held, each block a rectangle in its colour; a leak
// (live when the record ends, its scope exited) marked red at the end. A growable root's range is pale where only its
// addresses are held, and blue-grey where its granules are mapped. At the chosen moment: the
// free bytes, in how many pieces, and the largest free block, outlined; what is mapped.
(function () {
  const { formatSize, shortSize, lowerBound, RGBA } = GB;
  const GAP_SHARE = 0.03, GRID_T = 2048, GRID_A = 384, HELD = 0xffece7e4 >>> 0;
  const ADDRESSED = 0xfff7f5f4 >>> 0, MAPPED = 0xffe6d2bf >>> 0;  // #f4f5f7, #bfd2e6 as ABGR words
  const growable = (ds, root) => ds.mappings.some(m => m[0] === root);

  // The root's address ranges merged, each with its offset in the packed axis (bytes).
  GB.addressLayout = function (ds, root) {
    const ranges = ds.regions.filter(r => r[0] === root).map(r => [r[1], r[1] + r[2]]).sort((a, b) => a[0] - b[0]);
    const spans = [];
    for (const [a, b] of ranges) {
      const last = spans[spans.length - 1];
      if (last && a <= last.end) last.end = Math.max(last.end, b); else spans.push({ start: a, end: b });
    }
    let bytes = 0;
    for (const span of spans) { span.offset = bytes; bytes += span.end - span.start; }
    if (spans.length === 1) {  // one range: up to where blocks (or mappings) ever reached (and a bit more)
      let top = 0;
      for (let k = 0; k < ds.blocks.n; k++) if (ds.blocks.addr[k] >= 0 && ds.within(ds.blocks.b[k], root)) top = Math.max(top, ds.blocks.addr[k] + ds.blocks.size[k]);
      for (const m of ds.mappings) if (m[0] === root) top = Math.max(top, m[1] + m[2]);
      const reached = top - spans[0].start;
      if (reached > 0 && reached * 4 < bytes) { spans[0].end = spans[0].start + reached * 1.15; spans[0].cut = bytes; bytes = reached * 1.15; }
    }
    const gap = spans.length > 1 ? bytes * GAP_SHARE : 0, total = bytes + gap * (spans.length - 1), starts = spans.map(s => s.start);
    const pos = a => {  // where a lies on the axis, 0 at the bottom to 1 at the top
      const i = Math.max(0, lowerBound(starts, a + 1) - 1), span = spans[i];
      return (span.offset + Math.min(Math.max(a, span.start), span.end) - span.start + gap * i) / total;
    };
    return { root, spans, bytes, total, starts, pos };
  };

  function yMapper(layout, bottom, height) {  // address -> y (CSS pixels), low addresses at the bottom
    return addr => bottom - layout.pos(addr) * height;
  }

  const heldAt = (ds, list, root, t) => list.filter(r => r[0] === root && (r[3] < 0 || ds.times[r[3]] <= t) && (r[4] < 0 || ds.times[r[4]] > t));

  // Free memory of the root at t: held ranges minus live blocks; a growable root's mapped bytes.
  GB.freeAt = function (ds, root, t) {
    const held = heldAt(ds, ds.regions, root, t).map(r => [r[1], r[1] + r[2]]).sort((a, b) => a[0] - b[0]);
    const mapped = growable(ds, root) ? heldAt(ds, ds.mappings, root, t).reduce((n, m) => n + m[2], 0) : null;
    const live = Array.from(ds.liveAt(root, t)).filter(k => ds.blocks.addr[k] >= 0)
      .sort((a, b) => ds.blocks.addr[a] - ds.blocks.addr[b]);
    let free = 0, pieces = 0, largest = null, j = 0;
    for (const [start, end] of held) {
      let at = start;
      while (j < live.length && ds.blocks.addr[live[j]] < end) {
        const a = ds.blocks.addr[live[j]];
        if (a > at) { const gap = a - at; free += gap; pieces++; if (!largest || gap > largest.size) largest = { addr: at, size: gap }; }
        at = Math.max(at, a + ds.blocks.size[live[j]]); j++;
      }
      if (end > at) { const gap = end - at; free += gap; pieces++; if (!largest || gap > largest.size) largest = { addr: at, size: gap }; }
    }
    return { t, free, pieces, largest, held: held.reduce((n, [a, b]) => n + b - a, 0), live: live.length, mapped };
  };

  // The blocks of root's tree live in [v0, v1] (the held ranges grey beneath), painted into a
  // cols x rows picture (little-endian RGBA words, top row first).
  function render(app, root, layout, v0, v1, cols, rows) {
    const ds = app.ds, px = new Uint32Array(cols * rows), pos = layout.pos;
    const last = Math.min(ds.end, v1), perSecond = cols / (v1 - v0);
    const rowOf = a => rows - pos(a) * rows;
    function paint(t0, t1, a0, a1, colour) {
      const c0 = Math.max(0, Math.floor((t0 - v0) * perSecond)), c1 = Math.min(cols, Math.max(Math.ceil((t1 - v0) * perSecond), c0 + 1));
      const r0 = Math.max(0, Math.floor(rowOf(a1))), r1 = Math.min(rows, Math.max(Math.ceil(rowOf(a0)), r0 + 1));
      for (let r = r0; r < r1; r++) {
        const at = r * cols;
        if (c1 - c0 < 8) for (let c = c0; c < c1; c++) px[at + c] = colour; else px.fill(colour, at + c0, at + c1);
      }
    }
    const grows = growable(ds, root);
    for (const list of grows ? [ds.regions, ds.mappings] : [ds.regions]) {
      const colour = !grows ? HELD : list === ds.regions ? ADDRESSED : MAPPED;
      for (const [r, addr, size, from, to] of list) {
        if (r !== root) continue;
        const t0 = from < 0 ? 0 : ds.times[from], t1 = to < 0 ? ds.end : ds.times[to];
        if (t1 >= v0 && t0 <= v1) paint(Math.max(t0, v0), Math.min(t1, last), addr, addr + size, colour);
      }
    }
    const blocks = ds.blocks, rank = app.keys.rank, events = ds.events(root), times = ds.times;
    const addrs = blocks.addr, sizes = blocks.size, from = blocks.from, to = blocks.to;
    const first = ds.eventsBefore(root, v0), stop = ds.eventsBefore(root, v1);
    const span = layout.spans.length === 1 ? layout.spans[0] : null, perByte = rows / layout.total;
    const block = k => {
      const a = addrs[k];
      if (a < 0) return;
      const t0 = from[k] >= 0 && times[from[k]] > v0 ? times[from[k]] : v0, t1 = to[k] >= 0 && times[to[k]] < last ? times[to[k]] : last;
      const colour = RGBA[rank[k]];
      if (span !== null) {  // the common case, inline: one range
        const c0 = Math.max(0, Math.floor((t0 - v0) * perSecond)), c1 = Math.min(cols, Math.max(Math.ceil((t1 - v0) * perSecond), c0 + 1));
        const top = rows - (Math.min(a + sizes[k], span.end) - span.start) * perByte, bottom = rows - (Math.min(a, span.end) - span.start) * perByte;
        const r0 = Math.max(0, Math.floor(top)), r1 = Math.min(rows, Math.max(Math.ceil(bottom), r0 + 1));
        for (let r = r0; r < r1; r++) for (let c = r * cols + c0, e = r * cols + c1; c < e; c++) px[c] = colour;
      } else paint(t0, t1, a, a + sizes[k], colour);
    };
    let drawn = 0;
    for (const k of ds.liveAtIndex(root, first)) { block(k); drawn++; }
    const ev = events.ev;
    for (let i = first; i < stop; i++) if (ev[i] > 0) { block(ev[i] - 1); drawn++; }
    return { px, drawn };
  }

  GB.drawAddresses = function (app) {
    const canvas = app.addressCanvas, ctx = canvas.getContext("2d"), ds = app.ds, s = app.state;
    const ratio = window.devicePixelRatio || 1, width = app.sizes.addresses, height = app.sizes.addressHeight;
    canvas.width = Math.round(width * ratio); canvas.height = Math.round(height * ratio);
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const root = app.addressRoot();
    if (!app.layouts.has(root)) app.layouts.set(root, GB.addressLayout(ds, root));
    const layout = app.layout = app.layouts.get(root);
    const title = document.getElementById("address-title");
    if (!layout.spans.length) {
      title.textContent = "Addresses of " + ds.budgets[root].name + ": no block has an address";
      return { root, blocks: 0 };
    }
    const GUTTER = GB.GUTTER, w = app.plotWidth(), top = 6, bottom = height - 6, plotH = bottom - top;
    const y = app.addressY = yMapper(layout, bottom, plotH);
    const cols = Math.round(w * ratio), rows = Math.round(plotH * ratio);
    const image = new ImageData(Math.max(cols, 1), Math.max(rows, 1)), px = new Uint32Array(image.data.buffer);
    let drawn;
    if ((s.v1 - s.v0) / ds.end * GRID_T >= cols && rows <= GRID_A && s.v0 >= 0) {  // from the run's picture
      const key = root + "/" + app.keys.mode;
      if (!app.grids.has(key)) app.grids.set(key, render(app, root, layout, 0, ds.end, GRID_T, GRID_A));
      const grid = app.grids.get(key), span = s.v1 - s.v0, lastCol = Math.min(cols, Math.ceil((ds.end - s.v0) / span * cols));
      const column = new Int32Array(cols);
      for (let c = 0; c < lastCol; c++) column[c] = Math.min(GRID_T - 1, Math.floor((s.v0 + (c + 0.5) / cols * span) / ds.end * GRID_T));
      for (let r = 0; r < rows; r++) {
        const from = Math.floor((r + 0.5) / rows * GRID_A) * GRID_T, at = r * cols;
        for (let c = 0; c < lastCol; c++) px[at + c] = grid.px[from + column[c]];
      }
      drawn = grid.drawn;
    } else {
      const found = render(app, root, layout, s.v0, s.v1, cols, rows);
      px.set(found.px); drawn = found.drawn;
    }
    ctx.putImageData(image, Math.round(GUTTER * ratio), Math.round(top * ratio));  // first: cheap
    GB.drawTimeAxis(ctx, app, height, true, false);  // the lanes carry the time labels
    // the gutter: the root, the address axis (offsets from each range's start)
    ctx.fillStyle = "#1d2330"; ctx.font = "12px system-ui";
    ctx.fillText(ds.budgets[root].name, 4, top + 12);
    ctx.fillStyle = "#667085"; ctx.font = "11px system-ui";
    const cut = layout.spans[0].cut;
    ctx.fillText(cut ? "the lowest " + formatSize(layout.bytes) + " of " + formatSize(cut) : formatSize(layout.bytes) +
      (layout.spans.length > 1 ? " in " + layout.spans.length + " ranges" : ""), 4, top + 26);
    if (growable(ds, root)) {  // the key to the two greys
      ctx.fillStyle = "#bfd2e6"; ctx.fillRect(4, top + 33, 10, 10);
      ctx.fillStyle = "#667085"; ctx.fillText("mapped", 18, top + 42);
    }
    ctx.fillText("0x" + layout.spans[0].start.toString(16), 4, bottom - 2);
    ctx.textAlign = "right";
    const step = GB.sizeStep(layout.bytes, 4);
    if (layout.spans.length === 1) for (let v = step; v < layout.bytes; v += step) ctx.fillText("+" + shortSize(v), GUTTER - 6, y(layout.spans[0].start + v) + 4);
    ctx.textAlign = "left";
    const blocks = ds.blocks;
    if (ds.end >= s.v0 && ds.end <= s.v1) {  // the leaks, where the record ends
      const x = app.xOf(ds.end);
      ctx.fillStyle = "#d92d20";
      for (const k of ds.leaks) {
        if (blocks.addr[k] < 0 || !ds.within(blocks.b[k], root)) continue;
        const y0 = y(blocks.addr[k] + blocks.size[k]), y1 = y(blocks.addr[k]);
        ctx.fillRect(x - 3, y0, 3, Math.max(y1 - y0, 1));
      }
    }
    if (s.block !== null && blocks.addr[s.block] >= 0 && ds.within(blocks.b[s.block], root)) {
      const k = s.block, x0 = app.xOf(Math.max(ds.t0(k), s.v0)), x1 = app.xOf(Math.min(ds.t1(k), ds.end, s.v1));
      ctx.strokeStyle = "#f79009"; ctx.lineWidth = 2;
      ctx.strokeRect(x0, y(blocks.addr[k] + blocks.size[k]) - 1, Math.max(x1 - x0, 2), Math.max(y(blocks.addr[k]) - y(blocks.addr[k] + blocks.size[k]), 1) + 2);
      ctx.lineWidth = 1;
    }
    let free = null;
    if (s.moment !== null) {
      free = GB.freeAt(ds, root, s.moment);
      if (s.moment >= s.v0 && s.moment <= s.v1) {
        const x = app.xOf(s.moment);
        ctx.fillStyle = "#f79009"; ctx.fillRect(x - 1, top, 2, plotH);
        if (free.largest) {
          const y0 = y(free.largest.addr + free.largest.size), y1 = y(free.largest.addr);
          ctx.strokeStyle = "#f79009"; ctx.lineWidth = 2; ctx.strokeRect(x - 6, y0, 12, Math.max(y1 - y0, 2)); ctx.lineWidth = 1;
        }
      }
      const share = free.free ? 100 * (1 - free.largest.size / free.free) : 0;
      title.textContent = "Addresses of " + ds.budgets[root].name + " at " + ds.formatTime(s.moment, ds.end) + ": " +
        formatSize(free.free) + " free of " + formatSize(free.held) + (free.pieces ? " in " + free.pieces + (free.pieces === 1 ? " piece" : " pieces") + ", the largest " +
        formatSize(free.largest.size) + " at 0x" + free.largest.addr.toString(16) + " (" + share.toFixed(0) + "% of the free bytes are in smaller pieces)" : "") +
        (free.mapped !== null ? "; " + formatSize(free.mapped) + " mapped" : "");
    } else title.textContent = "Addresses of " + ds.budgets[root].name;
    return { root, blocks: drawn, free };
  };

  // The block under (x, y) of the address view, and the moment there.
  GB.addressHit = function (app, x, yPx) {
    const ds = app.ds, layout = app.layout;
    if (!layout || !layout.spans.length || x < GB.GUTTER) return null;
    const t = Math.min(Math.max(app.tOf(x), 0), ds.end);
    let block = null;
    for (const k of ds.liveAt(layout.root, t)) {
      const a = ds.blocks.addr[k];
      if (a >= 0 && app.addressY(a) + 0.5 >= yPx && app.addressY(a + ds.blocks.size[k]) - 0.5 <= yPx) { block = k; break; }
    }
    return { t, block, root: layout.root };
  };
})();
