"""`shadefs demo`: the bundled digits dataset, a training loop and the plot."""
