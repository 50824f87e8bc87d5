import engine  # noqa: F401 - first: importing the engine picks the BLAS MLX will call, before anything imports MLX
