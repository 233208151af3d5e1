"""The rank's side of a training job, in each rank's proc: the trainer actor (`worker`), one
training step (`step`), how the model is wrapped for the strategy (`parallelize`), and the
progress it reports even while stuck (`monitor`). The controller's side is
`raymesh.train.control`; what the two say to each other is `raymesh.train.protocol`."""
