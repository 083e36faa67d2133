"""Why the model scored an entity as it did: Integrated Gradients (Captum) over the network's inputs,
summed into what a person reads.

Every input of the network belongs to one group:

- value     one value of a categorical column (source -> column -> value): its decayed counts and
            recency in the histogram inputs, and for a label head (multilabel, recommendation) the
            entity's own history of that label ("brand = Acme: bought 6 times, last 41 days ago");
- recency / frequency / money   the entity's scalars (days since the last event, events and visits
            per window, sums and means of each numeric column);
- attribute one entity attribute (segment, age, signup date), whatever its one-hot or value/missing
            inputs.

The baseline is "an entity we know nothing about": no history at all (counts, sums and every value's
history at zero, the days since the first and the last event at the largest value seen in training)
and the population's average attributes (the trunk's input means). Integrated Gradients then
splits score - baseline score over the inputs (completeness); what the integration misses is the
`gap`, reported with every explanation. Scores are in the units predictions report them
(probabilities, amounts; raw scores for recommended items), from the fp32 network, through the
same `model(x, history)` call predict makes. Where the scenario's head chosen on validation blends
LightGBM trees in, the served score is explained instead (`served`: the network's Integrated Gradients
and the trees' exact contributions, weighted as the blend weighs them, in the same groups).

Modules: `inputs` (the group of every input and its name), `integrated` (Integrated Gradients of a
batch: Explainer), `reasons` (groups summed into ranked, readable reasons) and `summary` (a cut-off
explained chunk by chunk, and what a run adds up), `served` (a stacked head's served score: ServedExplainer).
"""

from habitus.models.explain.inputs import Groups, column_sources, input_groups, scalar_names, vocab_reader
from habitus.models.explain.integrated import DEFAULT_STEPS, Explained, Explainer
from habitus.models.explain.served import ServedExplainer
from habitus.models.explain.reasons import column_totals, rendered, top_reasons, value_stats
from habitus.models.explain.summary import DEFAULT_SELECT, DEFAULT_SHARE, SELECT, Summary, chosen, default_per_entity, explain_cutoff

__all__ = ["DEFAULT_SELECT", "DEFAULT_SHARE", "DEFAULT_STEPS", "Explained", "Explainer", "Groups", "SELECT", "ServedExplainer", "Summary",
           "chosen", "column_sources", "column_totals", "default_per_entity", "explain_cutoff", "input_groups",
           "rendered", "scalar_names", "top_reasons", "value_stats", "vocab_reader"]
