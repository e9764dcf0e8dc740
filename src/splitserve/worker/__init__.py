"""The worker's composition root: what one ``splitserve worker`` process is built from (see ``build``)."""
