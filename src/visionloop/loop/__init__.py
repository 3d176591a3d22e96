"""The retraining loop (`visionloop loop`): a trigger (new labels, drift, a schedule) opens a
round; the round makes the next dataset version, trains on the queue from the champion's
weights, registers, evaluates against the champion and promotes through the gate. State and
events under `<home>/loops/<name>/`; a crash resumes at the step it was in."""
