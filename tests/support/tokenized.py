"""The tokenized data's Arrow file edited in place, as a damaged or changed file would be."""

import numpy as np
import pyarrow as pa


def rewrite_ids(path, change):
    """The Arrow file at `path` with each sample's token ids replaced by `change(sample_id, ids)`;
    schema, record batches and row count kept."""
    reader = pa.ipc.open_file(pa.BufferReader(path.read_bytes()))
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, reader.schema) as writer:
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            ids = [
                change(sid, np.array(row, dtype=np.int32)).tolist()
                for sid, row in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist())
            ]
            writer.write_batch(
                pa.RecordBatch.from_arrays(
                    [batch.column(0), pa.array(ids, pa.list_(pa.int32())), batch.column(2), batch.column(3)],
                    schema=reader.schema,
                )
            )
