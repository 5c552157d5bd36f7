"""The paper's evaluation instructions (Appendix H, Tables 14 and 15) as data.

Per-task instructions win over per-task-type ones. Retrieval and reranking put the instruction
on the query only (documents are embedded once, without it); every other task type puts it on
every text. The paper's table writes several tasks in one row ("Arxiv(Hierarchical)ClusteringP2P",
"BiorxivClusteringP2P(.v2)", "MIRACLRetrievalHardNegatives / NQ"); here each mteb task name is
its own key, so a lookup is exact.

    instruction_for("SciFact", "Retrieval")  -> "Given a scientific claim, retrieve ..."
    instruction_for("STS12", "STS")          -> "Retrieve semantically similar text."
    applies_to("Retrieval", "document")      -> False
"""

from __future__ import annotations

# Table 14: per task type
TASK_TYPE_INSTRUCTIONS: dict[str, str] = {
    "STS": "Retrieve semantically similar text.",
    "Summarization": "Given a news summary, retrieve other semantically similar summaries",
    "BitextMining": "Retrieve parallel sentences.",
}


def _rows(*rows):
    """(names, instruction) rows, a row naming one or more mteb tasks."""
    out = {}
    for names, instruction in rows:
        for name in (names,) if isinstance(names, str) else names:
            if name in out:
                raise AssertionError(f"{name} listed twice")
            out[name] = instruction
    return out


# Table 15: per task (each variant the paper writes in parentheses spelled out)
TASK_INSTRUCTIONS: dict[str, str] = _rows(
    ("AmazonCounterfactualClassification",
     "Classify a given Amazon customer review text as either counterfactual or not-counterfactual"),
    ("AmazonPolarityClassification", "Classify Amazon reviews into positive or negative sentiment"),
    ("AmazonReviewsClassification", "Classify the given Amazon review into its appropriate rating category"),
    ("ArguAna", "Given a claim, find documents that refute the claim"),
    (("ArxivClusteringP2P", "ArXivHierarchicalClusteringP2P"),
     "Identify the main and secondary category of Arxiv papers based on the titles and abstracts"),
    (("ArxivClusteringS2S", "ArXivHierarchicalClusteringS2S"),
     "Identify the main and secondary category of Arxiv papers based on the titles"),
    ("AskUbuntuDupQuestions", "Retrieve duplicate questions from AskUbuntu forum"),
    ("Banking77Classification", "Given an online banking query, find the corresponding intents"),
    (("BiorxivClusteringP2P", "BiorxivClusteringP2P.v2"),
     "Identify the main category of Biorxiv papers based on the titles and abstracts"),
    ("BiorxivClusteringS2S", "Identify the main category of Biorxiv papers based on the titles"),
    (("CQADupstackGamingRetrieval", "CQADupstackUnixRetrieval"),
     "Given a question, retrieve detailed question descriptions from Stackexchange that are duplicates to the "
     "given question"),
    (("ClimateFEVER", "ClimateFEVERHardNegatives"),
     "Given a claim about climate change, retrieve documents that support or refute the claim"),
    ("CovidRetrieval", "Given a question on COVID-19, retrieve news articles that answer the question"),
    ("DBPedia", "Given a query, retrieve relevant entity descriptions from DBPedia"),
    ("EmotionClassification", "Classify the emotion expressed in the given Twitter message into one of the six "
                              "emotions: anger, fear, joy, love, sadness, and surprise"),
    (("FEVER", "FEVERHardNegatives"), "Given a claim, retrieve documents that support or refute the claim"),
    ("FiQA2018", "Given a financial question, retrieve user replies that best answer the question"),
    (("HotpotQA", "HotpotQAHardNegatives"),
     "Given a multi-hop question, retrieve documents that can help answer the question"),
    ("ImdbClassification", "Classify the sentiment expressed in the given movie review text from the IMDB dataset"),
    (("MIRACLRetrievalHardNegatives", "NQ"), "Given a question, retrieve Wikipedia passages that answer the question"),
    ("MSMARCO", "Given a web search query, retrieve relevant passages that answer the query"),
    ("MTOPDomainClassification", "Classify the intent domain of the given utterance in task-oriented conversation"),
    ("MTOPIntentClassification", "Classify the intent of the given utterance in task-oriented conversation"),
    ("MassiveIntentClassification", "Given a user utterance as a query, find the user intents"),
    ("MassiveScenarioClassification", "Given a user utterance as a query, find the user scenarios"),
    (("MedrxivClusteringP2P", "MedrxivClusteringP2P.v2"),
     "Identify the main category of Medrxiv papers based on the titles and abstracts"),
    (("MedrxivClusteringS2S", "MedrxivClusteringS2S.v2"),
     "Identify the main category of Medrxiv papers based on the titles"),
    ("MindSmallReranking", "Retrieve relevant news articles based on user browsing history"),
    ("NFCorpus", "Given a question, retrieve relevant documents that best answer the question"),
    ("QuoraRetrieval", "Given a question, retrieve questions that are semantically equivalent to the given question"),
    ("RedditClustering", "Identify the topic or theme of Reddit posts based on the titles"),
    ("RedditClusteringP2P", "Identify the topic or theme of Reddit posts based on the titles and posts"),
    ("SCIDOCS", "Given a scientific paper title, retrieve paper abstracts that are cited by the given paper"),
    ("SciDocsRR", "Given a title of a scientific paper, retrieve the titles of other relevant papers"),
    ("SciFact", "Given a scientific claim, retrieve documents that support or refute the claim"),
    ("SprintDuplicateQuestions", "Retrieve duplicate questions from Sprint forum"),
    (("StackExchangeClustering", "StackExchangeClustering.v2"),
     "Identify the topic or theme of StackExchange posts based on the titles"),
    (("StackExchangeClusteringP2P", "StackExchangeClusteringP2P.v2"),
     "Identify the topic or theme of StackExchange posts based on the given paragraphs"),
    ("StackOverflowDupQuestions", "Retrieve duplicate questions from StackOverflow forum"),
    ("T2Reranking", "Given a Chinese search query, retrieve web passages that answer the question"),
    ("TRECCOVID", "Given a query on COVID-19, retrieve documents that answer the query"),
    (("Touche2020", "Touche2020Retrieval.v3"),
     "Given a question, retrieve detailed and persuasive arguments that answer the question"),
    ("ToxicConversationsClassification", "Classify the given comments as either toxic or not toxic"),
    ("TweetSentimentExtractionClassification",
     "Classify the sentiment of a given tweet as either positive, negative, or neutral"),
    (("TwentyNewsgroupsClustering", "TwentyNewsgroupsClustering.v2"),
     "Identify the topic or theme of the given news articles"),
    (("TwitterSemEval2015", "TwitterURLCorpus"), "Retrieve tweets that are semantically similar to the given tweet"),
)

# Appendix H: "for retrieval and reranking tasks, we prepend the instruction to the query only"
# (mteb's instruction-following variants are retrieval and reranking too)
QUERY_ONLY_TASK_TYPES = frozenset({"Retrieval", "Reranking", "InstructionRetrieval", "InstructionReranking"})


def instruction_for(task_name: str, task_type: str, *, task_instructions=None, type_instructions=None) -> str | None:
    """The instruction of a task: per task, else per task type, else None (no instruction).

    The paper names two CQADupstack forums; MTEB(eng, v1)'s CQADupstackRetrieval averages twelve,
    and each of them gets the same CQADupstack instruction (as E5 does)."""
    task_instructions = TASK_INSTRUCTIONS if task_instructions is None else task_instructions
    type_instructions = TASK_TYPE_INSTRUCTIONS if type_instructions is None else type_instructions
    if task_name in task_instructions:
        return task_instructions[task_name]
    if task_name.startswith("CQADupstack") and "CQADupstackGamingRetrieval" in task_instructions:
        return task_instructions["CQADupstackGamingRetrieval"]
    return type_instructions.get(task_type)


def applies_to(task_type: str, prompt_type: str | None) -> bool:
    """Whether a text of this role gets the instruction: queries always; documents only outside
    retrieval and reranking; texts with no role (STS pairs, clustering, ...) always."""
    if prompt_type == "document":
        return task_type not in QUERY_ONLY_TASK_TYPES
    return True
