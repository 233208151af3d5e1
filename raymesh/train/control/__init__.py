"""The controller's side of a training job, in the user's process: the run loop and its states
(`controller`, `states`), where ranks go (`placement`), the ranks and spares (`ranks`, `warm`),
the world they form and heal (`world`), who a failure lost (`detection`), and the policies that
decide (`failure`, `balance`), and where a job resumes (`resume`). The ranks' side is
`raymesh.train.rank`; what the two say to each other is `raymesh.train.protocol`."""
