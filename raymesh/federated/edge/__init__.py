"""Edge devices over HTTP(S): the controller's server for them (`server`: Starlette under
uvicorn, enrolment, long polls, replies), what it accepts as an answer's body (`bodies`), and
the client a device runs (`device`: standard-library HTTP only, no Ray, runnable as a plain
file beside a copy of the protocol room's client side).
"""
