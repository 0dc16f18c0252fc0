//! Consuming from JetStream: deliveries with double acks, task pulls, the event consumer.

use super::*;

/// Settles one JetStream delivery with double acks: each returns once the server has it.
pub(super) struct NatsAcker {
    pub(super) acker: jetstream::message::Acker,
}

impl NatsAcker {
    pub(super) async fn send(&self, kind: AckKind, what: &str) -> BusResult<()> {
        self.acker
            .double_ack_with(kind)
            .await
            .map_err(|e| backend(format!("{what} failed"), e))
    }
}

#[async_trait]
impl Acker for NatsAcker {
    async fn ack(&self) -> BusResult<()> {
        self.send(AckKind::Ack, "ack").await
    }

    async fn nak(&self, delay: Option<Duration>) -> BusResult<()> {
        self.send(AckKind::Nak(delay), "nak").await
    }

    async fn in_progress(&self) -> BusResult<()> {
        self.send(AckKind::Progress, "in-progress").await
    }
}

/// A task or event delivery, with the publisher's `traceparent` header (tasks carry one)
/// as its trace.
pub(super) fn delivery(msg: jetstream::Message) -> Delivery {
    let info = msg.info().ok();
    let attempt = info
        .as_ref()
        .map(|info| u32::try_from(info.delivered.max(1)).unwrap_or(u32::MAX))
        .unwrap_or(1);
    let seq = info.as_ref().map(|info| info.stream_sequence);
    let (msg, acker) = msg.split();
    let trace = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(TRACEPARENT))
        .map(|v| v.as_str().to_string());
    Delivery::new(msg.payload, attempt, trace, Box::new(NatsAcker { acker }))
        .with_position(None, seq)
}

/// One pull request for at most one message, held by the server for at most `wait`.
pub(super) async fn fetch_one(
    consumer: &consumer::PullConsumer,
    wait: Duration,
) -> Result<Option<jetstream::Message>, async_nats::Error> {
    let mut batch = if wait < Duration::from_millis(1) {
        consumer.fetch().max_messages(1).messages().await?
    } else {
        consumer
            .batch()
            .max_messages(1)
            .expires(wait)
            .messages()
            .await?
    };
    // The server ends the request at `wait`; the margin covers a lost end-of-request.
    match tokio::time::timeout(wait + Duration::from_secs(1), batch.next()).await {
        Ok(Some(Ok(msg))) => Ok(Some(msg)),
        Ok(Some(Err(e))) => Err(e),
        Ok(None) | Err(_) => Ok(None),
    }
}

/// The durable event consumer: one pull stream, reopened after any error.
pub(super) struct NatsEventConsumer {
    pub(super) js: jetstream::Context,
    pub(super) durable: String,
    pub(super) ack_wait: Duration,
    pub(super) messages: Option<consumer::pull::Stream>,
    pub(super) backoff: Backoff,
    /// A pull that fails (missed heartbeats: a frozen server keeps the connection) is a
    /// disruption the coordinator weighs dead tasks by.
    pub(super) disruptions: super::Disruptions,
}

impl NatsEventConsumer {
    pub(super) async fn open(&self) -> Result<consumer::pull::Stream, async_nats::Error> {
        let consumer: consumer::PullConsumer = self
            .js
            .create_consumer_on_stream(
                consumer::pull::Config {
                    durable_name: Some(self.durable.clone()),
                    description: Some("forkfleet event consumer".into()),
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: self.ack_wait,
                    max_deliver: -1,
                    max_ack_pending: MAX_ACK_PENDING,
                    ..Default::default()
                },
                subjects::EVENT_STREAM,
            )
            .await?;
        Ok(consumer
            .stream()
            .max_messages_per_batch(EVENT_BATCH)
            .heartbeat(PULL_HEARTBEAT)
            .expires(PULL_EXPIRES)
            .messages()
            .await?)
    }
}

#[async_trait]
impl EventConsumer for NatsEventConsumer {
    async fn next(&mut self) -> BusResult<Delivery> {
        loop {
            let messages = match &mut self.messages {
                Some(m) => m,
                None => match self.open().await {
                    Ok(m) => self.messages.insert(m),
                    Err(e) => {
                        self.disruptions.note();
                        let pause = self.backoff.next();
                        tracing::warn!(bus.durable = %self.durable, error = %e,
                            "bus.events open failed; retrying");
                        tokio::time::sleep(pause).await;
                        continue;
                    }
                },
            };
            match messages.next().await {
                Some(Ok(msg)) => {
                    self.backoff.reset();
                    return Ok(delivery(msg));
                }
                Some(Err(e)) => {
                    self.disruptions.note();
                    let pause = self.backoff.next();
                    tracing::warn!(bus.durable = %self.durable, error = %e,
                        "bus.events pull failed; reopening");
                    self.messages = None;
                    tokio::time::sleep(pause).await;
                }
                None => {
                    self.messages = None;
                    tokio::time::sleep(self.backoff.next()).await;
                }
            }
        }
    }
}
