"""What a trace gives the kernels: the compiled row scanner, the output token plan."""
