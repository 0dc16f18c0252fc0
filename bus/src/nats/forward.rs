//! Long-lived forwarders: control commands to a watching branch, dead tasks to the coordinator.

use super::*;

/// Forward the control commands of one subject, in order, until the receiver is dropped.
pub(super) async fn forward_control(
    js: jetstream::Context,
    subject: String,
    tx: mpsc::UnboundedSender<Bytes>,
    first: Option<consumer::pull::Ordered>,
    mut reconnects: Reconnects,
) {
    reconnects.borrow_and_update();
    let mut next_seq: Option<u64> = None;
    let mut backoff = Backoff::new();
    let mut first = first;
    loop {
        let opened = match first.take() {
            Some(messages) => Ok(messages),
            None => tokio::select! {
                _ = tx.closed() => return,
                opened = open_control(&js, &subject, next_seq) => opened,
            },
        };
        match opened {
            Ok(mut messages) => loop {
                tokio::select! {
                    _ = tx.closed() => return,
                    changed = reconnects.changed() => {
                        if changed.is_err() {
                            return; // the bus is gone
                        }
                        // The server may have restarted and lost the ephemeral consumer.
                        backoff.reset();
                        break;
                    }
                    item = messages.next() => match item {
                        Some(Ok(msg)) => {
                            backoff.reset();
                            if let Ok(info) = msg.info() {
                                next_seq = Some(info.stream_sequence + 1);
                            }
                            if tx.send(msg.message.payload).is_err() {
                                return;
                            }
                        }
                        Some(Err(e)) => {
                            tracing::warn!(nats.subject = %subject, error = %e,
                                "bus.control watch failed; reopening");
                            break;
                        }
                        None => break,
                    }
                }
            },
            Err(e) => {
                tracing::warn!(nats.subject = %subject, error = %e, "bus.control open failed");
            }
        }
        let pause = backoff.next();
        tokio::select! {
            _ = tx.closed() => return,
            _ = tokio::time::sleep(pause) => {}
        }
    }
}

pub(super) async fn open_control(
    js: &jetstream::Context,
    subject: &str,
    next_seq: Option<u64>,
) -> Result<consumer::pull::Ordered, async_nats::Error> {
    let deliver_policy = match next_seq {
        None => consumer::DeliverPolicy::All,
        Some(start_sequence) => consumer::DeliverPolicy::ByStartSequence { start_sequence },
    };
    let consumer = js
        .create_consumer_on_stream(
            consumer::pull::OrderedConfig {
                filter_subject: subject.to_string(),
                deliver_policy,
                ..Default::default()
            },
            subjects::CONTROL_STREAM,
        )
        .await?;
    Ok(consumer.messages().await?)
}

/// The max-deliveries advisory, as the server publishes it.
#[derive(Deserialize)]
pub(super) struct MaxDeliveriesAdvisory {
    pub(super) stream_seq: u64,
    #[serde(default)]
    pub(super) deliveries: u64,
}

/// What became of one advisory.
pub(super) enum Handled {
    /// Done with it: ack it.
    Ack,
    /// Try again later: leave it unacked, it comes back after the ack wait.
    Retry,
    /// The receiver is gone: stop, leaving the advisory for the next watcher.
    Stop,
}

/// One advisory: fetch the task by sequence, forward it, delete it from the stream.
pub(super) async fn handle_advisory(
    tasks: &stream::Stream<()>,
    pool: &str,
    payload: &[u8],
    tx: &mpsc::UnboundedSender<Bytes>,
) -> Handled {
    let advisory: MaxDeliveriesAdvisory = match serde_json::from_slice(payload) {
        Ok(a) => a,
        Err(e) => {
            tracing::warn!(bus.pool = %pool, error = %e, "bus.dead_tasks bad advisory dropped");
            return Handled::Ack;
        }
    };
    let seq = advisory.stream_seq;
    let task = match tasks.get_raw_message(seq).await {
        Ok(task) => task,
        // Already handled by another watcher.
        Err(e) if e.kind() == stream::RawMessageErrorKind::NoMessageFound => return Handled::Ack,
        Err(e) => {
            tracing::warn!(bus.pool = %pool, task.seq = seq, error = %e,
                "bus.dead_tasks cannot fetch the dead task");
            return Handled::Retry;
        }
    };
    tracing::error!(bus.pool = %pool, task.seq = seq, deliveries = advisory.deliveries,
        "bus.dead_letter: task exceeded max_deliver");
    if tx.send(task.payload).is_err() {
        return Handled::Stop;
    }
    if let Err(e) = tasks.delete_message(seq).await {
        tracing::warn!(bus.pool = %pool, task.seq = seq, error = %e,
            "bus.dead_tasks cannot delete the dead task");
    }
    Handled::Ack
}

/// Forward the dead tasks of `pool` until the receiver is dropped.
pub(super) async fn forward_dead(
    js: jetstream::Context,
    consumer: consumer::PullConsumer,
    pool: String,
    tx: mpsc::UnboundedSender<Bytes>,
) {
    let tasks = match js.get_stream_no_info(subjects::TASK_STREAM).await {
        Ok(s) => s,
        Err(e) => {
            tracing::error!(bus.pool = %pool, error = %e, "bus.dead_tasks no task stream");
            return;
        }
    };
    let mut backoff = Backoff::new();
    loop {
        let open = consumer
            .stream()
            .max_messages_per_batch(16)
            .heartbeat(PULL_HEARTBEAT)
            .expires(PULL_EXPIRES)
            .messages();
        let opened = tokio::select! {
            _ = tx.closed() => return,
            opened = open => opened,
        };
        let mut advisories = match opened {
            Ok(advisories) => advisories,
            Err(e) => {
                tracing::warn!(bus.pool = %pool, error = %e, "bus.dead_tasks open failed");
                tokio::select! {
                    _ = tx.closed() => return,
                    _ = tokio::time::sleep(backoff.next()) => continue,
                }
            }
        };
        loop {
            let item = tokio::select! {
                _ = tx.closed() => return,
                item = advisories.next() => item,
            };
            let msg = match item {
                Some(Ok(msg)) => msg,
                Some(Err(e)) => {
                    tracing::warn!(bus.pool = %pool, error = %e, "bus.dead_tasks pull failed");
                    break;
                }
                None => break,
            };
            backoff.reset();
            match handle_advisory(&tasks, &pool, &msg.payload, &tx).await {
                Handled::Ack => {
                    if let Err(e) = msg.double_ack().await {
                        tracing::warn!(bus.pool = %pool, error = %e, "bus.dead_tasks ack failed");
                    }
                }
                Handled::Retry => {}
                Handled::Stop => return,
            }
        }
        tokio::select! {
            _ = tx.closed() => return,
            _ = tokio::time::sleep(backoff.next()) => {}
        }
    }
}
