"""What capture assumes and checks rather than knows: both sides of tensor branches, raising branches, deferred numbers and .item() values, writes the graph defers."""
