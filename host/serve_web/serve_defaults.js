// Loaded by `lowvram-lora serve` only (never by ComfyUI): the editor's built-in default graph (an SD1.5
// text-to-image graph) uses ComfyUI nodes this server does not have, and loading it opens a "Some Nodes Are
// Missing" dialog. Start from an empty graph instead; the template browser offers our workflows.
const graph = window.comfyAPI?.defaultGraph?.defaultGraph;
if (graph) {
  Object.assign(graph, { last_node_id: 0, last_link_id: 0, nodes: [], links: [], groups: [] });
}
