"""What a model's modules are: the role vocabulary, the trace of a forward, the roles read from it,
fused projections and experts."""
