//! The long-lived forwarder of control commands to a watching branch.

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
