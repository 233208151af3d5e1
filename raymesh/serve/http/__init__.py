"""The HTTP front: the Starlette app (run by uvicorn) that checks each request before it is
served (`guard`: its bearer token, body size and rate; `inputs`: its values) and answers it
through the router (`front`)."""
