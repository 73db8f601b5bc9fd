"""Models of library callables and objects over values: builtins, methods of built-in kinds, the standard library, nn.Module, optimizers, torch objects, grad mode, printing, training."""
