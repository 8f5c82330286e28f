"""Cross-chain links drawn through Reroute nodes, so they run where the user can see them.

A template with several training chains (``TrainingTemplate.chain_links``: Wan 2.2 A14B's two experts) links
one chain's Load Quantized Slab into another chain's Train LoRA. Drawn straight, such a link runs diagonally
behind the nodes between (the Cache Text Embeds column), where nobody sees it. ``plan`` gives each such link two
of the frontend's classic ``Reroute`` nodes (a virtual node: one ``*`` input, one output; ``graphToPrompt``,
comfy-cli and ``host.workflow`` follow it, so the API prompt is the same), placed in the empty band between the
two chains' rows:

- the first below (or above) the gap right of the source's column, so the link drops (or rises) from the
  source's output through that gap (``SOURCE_RUN``);
- the second below (or above) the gap left of the target's column, so the link rises (or drops) into the
  target's input through that gap (``TARGET_RUN``).

The reroute near the upper chain's node sits on the band's upper level, the one near the lower chain's node on
its lower level: a downward and an upward link between the same two chains then use different heights in each
gap and cross once, in the open band. Every piece is checked against every other box (title bars included, as
LiteGraph draws them), both as a straight line (the "linear"/"straight" link modes) and as the spline the frontend
draws by default, and a route that would pass under a node is an error, not a file. The spline bows sideways by
about 7% of its length, so the column gaps the links run through are wider (``templates.ROUTE_GAP``).
"""
from __future__ import annotations

from dataclasses import dataclass

#: LiteGraph's classic Reroute node (frontend ``RerouteNode.computeSize``: 75 x 26, drawn without a title bar).
REROUTE_SIZE = (75, 26)
#: LiteGraph.NODE_SLOT_HEIGHT: slot ``i`` sits ``(i + 0.7) * SLOT_H`` below ``pos``.
SLOT_H = 20
#: Where in the column gap (a fraction of its width) the run down/up from the source and the run into the target
#: stand. The spline leaves a reroute to the right, towards the target's column, and bows that way by about 7% of
#: its length: the run into the target keeps further from it.
SOURCE_RUN, TARGET_RUN = 0.5, 0.6


@dataclass(frozen=True)
class Request:
    """A link to route: ``src`` output ``src_slot`` into ``dst``'s socket row ``dst_row`` (its index among the
    node's socket inputs, which is where the frontend draws it), between chains ``src_chain`` and ``dst_chain``."""
    src: int
    src_slot: int
    dst: int
    dst_row: int
    src_chain: int
    dst_chain: int


def output_point(box: list, slot: int) -> tuple[float, float]:
    return box[0] + box[2], box[1] + (slot + 0.7) * SLOT_H


def input_point(box: list, row: int) -> tuple[float, float]:
    return box[0], box[1] + (row + 0.7) * SLOT_H


def reroute_points(box: list) -> tuple[tuple[float, float], tuple[float, float]]:
    """(input, output) of a reroute box: the middle of its left and right edges."""
    return (box[0], box[1] + box[3] / 2), (box[0] + box[2], box[1] + box[3] / 2)


def crosses(p: tuple[float, float], q: tuple[float, float], box: list) -> bool:
    """Whether segment p-q passes through the open rectangle ``box`` ([x, y, w, h]) (Liang-Barsky clipping)."""
    t0, t1 = 0.0, 1.0
    dx, dy = q[0] - p[0], q[1] - p[1]
    for d, lo, hi, at in ((dx, box[0], box[0] + box[2], p[0]), (dy, box[1], box[1] + box[3], p[1])):
        if d == 0:
            if not lo < at < hi:
                return False
            continue
        a, b = sorted(((lo - at) / d, (hi - at) / d))
        t0, t1 = max(t0, a), min(t1, b)
        if t0 >= t1:
            return False
    return True


def spline(p: tuple[float, float], q: tuple[float, float]) -> list[tuple[float, float]]:
    """Points along the link p -> q as the frontend draws it by default (LinkRenderType.SPLINE_LINK: a cubic
    Bezier leaving the output to the right and entering the input from the left, control points a quarter of
    the distance out), about one per pixel."""
    d = ((q[0] - p[0]) ** 2 + (q[1] - p[1]) ** 2) ** 0.5
    c1, c2 = (p[0] + d / 4, p[1]), (q[0] - d / 4, q[1])
    n = int(1.5 * d) + 8
    return [tuple((1 - t) ** 3 * a + 3 * (1 - t) ** 2 * t * b + 3 * (1 - t) * t * t * c + t ** 3 * e
                  for a, b, c, e in zip(p, c1, c2, q)) for t in (i / n for i in range(n + 1))]


def _inside(point: tuple[float, float], box: list) -> bool:
    return box[0] < point[0] < box[0] + box[2] and box[1] < point[1] < box[1] + box[3]


def plan(requests: list[Request], boxes: dict[int, list], frames: dict[int, list], chain: dict[int, int],
         first_id: int, gap: int, run_gap: int) -> list[list[tuple[int, list]]]:
    """The reroutes of each request, ``[(reroute id, [x, y, w, h]), ...]`` in link order, ids from ``first_id``.
    ``boxes``: every node's and note's body ([x, y, w, h], what ``pos``/``size`` hold); ``frames``: the area the
    editor paints for each (title bar included); ``chain``: each training node's chain (notes have none);
    ``gap``: the space kept to the chains' rows; ``run_gap``: the width of the column gaps right of a source and
    left of a target. Raises ValueError naming the link when a reroute would overlap a node or a piece of the
    link would pass under one (the two it joins included: only its ends may touch them)."""
    routes, paths, next_id = [], [], first_id
    for r in requests:
        upper, lower = sorted((r.src_chain, r.dst_chain))
        top = max(f[1] + f[3] for i, f in frames.items() if chain.get(i) == upper)
        bottom = min(f[1] for i, f in frames.items() if chain.get(i) == lower)
        lo, hi = top + gap, bottom - gap - REROUTE_SIZE[1]
        if hi <= lo:
            raise ValueError(f"no room between chains {upper} and {lower} for the reroutes of the link {r.src} -> "
                             f"{r.dst}: lay the chains further apart")
        levels = (round(lo + (hi - lo) / 3), round(lo + 2 * (hi - lo) / 3))
        src, dst = boxes[r.src], boxes[r.dst]
        near_src = round(src[0] + src[2] + SOURCE_RUN * run_gap)
        near_dst = round(dst[0] - TARGET_RUN * run_gap) - REROUTE_SIZE[0]
        route = [(next_id, [near_src, levels[r.src_chain != upper], *REROUTE_SIZE]),
                 (next_id + 1, [near_dst, levels[r.dst_chain != upper], *REROUTE_SIZE])]
        next_id += 2
        routes.append(route)
        paths.append([(r.src, output_point(src, r.src_slot)),
                      *((i, p) for i, b in route for p in reroute_points(b)), (r.dst, input_point(dst, r.dst_row))])
    everything = dict(frames)
    everything.update((i, b) for route in routes for i, b in route)
    for route, path in zip(routes, paths):
        for rid, box in route:
            hit = [i for i, b in everything.items() if i != rid and _overlap(box, b)]
            if hit:
                raise ValueError(f"reroute {rid} at {box[:2]} of the link {path[0][0]} -> {path[-1][0]} would "
                                 f"overlap node(s) {hit}")
        for (a, p), (b, q) in zip(path[::2], path[1::2]):
            curve = spline(p, q)
            hit = [i for i, f in everything.items() if crosses(p, q, f) or any(_inside(c, f) for c in curve)]
            if hit:
                raise ValueError(f"the link {path[0][0]} -> {path[-1][0]} would pass under node(s) {hit} between "
                                 f"{a} and {b}; its reroutes cannot be placed in this layout")
    return routes


def _overlap(a: list, b: list) -> bool:
    return a[0] < b[0] + b[2] and b[0] < a[0] + a[2] and a[1] < b[1] + b[3] and b[1] < a[1] + a[3]
