"""A `torch.compile` backend for tests that counts captured graphs instead of compiling them."""


def graph_counter():
    """`(backend, graphs)`: a backend that runs the captured graph eagerly and appends every (re)compilation's graph
    to `graphs`.

    A plain function, not an instance: generate deep-copies its compile config each round, and a copied backend
    object would compare unequal and force a fresh `torch.compile`."""
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    return backend, graphs
