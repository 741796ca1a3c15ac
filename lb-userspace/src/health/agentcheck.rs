//! Agent checks (`[vip.agent]`): every interval the agent connects to each backend's
//! agent port and reads one line in HAProxy's agent-check words ("75%", "drain",
//! "ready", "maint", "down", "up"). The backend so reports its own load or asks to be
//! drained (a pre-stop hook). A malformed or missing answer changes nothing and is
//! logged; the file and runtime commands keep priority over what an agent says.

use std::{
    collections::HashSet,
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use tokio::{io::AsyncReadExt, net::TcpStream};
use tokio_util::sync::CancellationToken;

use crate::{
    config::AgentCheckConfig,
    model::{
        Model,
        weights::{AgentReplyError, AgentReport, parse_agent_reply},
    },
};

/// The most of an answer that is read: one line is all there is to say.
const ANSWER_CAP: usize = 512;

/// The agent's state as the agent-check tasks see it.
pub trait AgentHost: Send + 'static {
    fn model(&self) -> &Model;
    /// Takes backend `id`'s answer (or why there was none usable); rewrites the tables
    /// when it changes what the backend gets.
    fn record_agent(&mut self, id: u32, answer: Result<AgentReport, impl std::fmt::Display>);
}

/// The backends whose agent-check task runs.
#[derive(Clone, Default)]
pub struct Tasks {
    running: Arc<Mutex<HashSet<u32>>>,
}

/// Starts an agent-check task for every backend of a VIP with `[vip.agent]` that has
/// none yet; tasks end when their backend or its VIP's `[vip.agent]` goes.
pub fn spawn<H: AgentHost>(host: &Arc<Mutex<H>>, tasks: &Tasks, shutdown: &CancellationToken) {
    let guard = host.lock().expect("agent state poisoned");
    let mut running = tasks.running.lock().expect("agent task set poisoned");
    for vip in guard
        .model()
        .vips
        .iter()
        .filter(|v| v.config.agent.is_some())
    {
        for backend in &vip.backends {
            if running.insert(backend.id) {
                tokio::spawn(agent_loop(
                    backend.id,
                    host.clone(),
                    tasks.clone(),
                    shutdown.clone(),
                ));
            }
        }
    }
}

/// What to ask for backend `id`, if its VIP has agent checks.
fn target(model: &Model, id: u32) -> Option<(AgentCheckConfig, SocketAddr)> {
    model.vips.iter().find_map(|v| {
        let agent = v.config.agent.as_ref()?;
        let b = v.backends.iter().find(|b| b.id == id)?;
        Some((agent.clone(), SocketAddr::new(b.config.address, agent.port)))
    })
}

async fn agent_loop<H: AgentHost>(
    id: u32,
    host: Arc<Mutex<H>>,
    tasks: Tasks,
    shutdown: CancellationToken,
) {
    let mut first = true;
    loop {
        let found = target(host.lock().expect("agent state poisoned").model(), id);
        let Some((config, address)) = found else {
            // Deregister under the host's lock (as `spawn` holds it): a backend that
            // came back meanwhile found this task still registered.
            let guard = host.lock().expect("agent state poisoned");
            if target(guard.model(), id).is_some() {
                continue;
            }
            tasks
                .running
                .lock()
                .expect("agent task set poisoned")
                .remove(&id);
            return;
        };
        // The first question comes soon, at a random point so that backends are not
        // all asked at once; later ones every interval, with ±10% jitter.
        let delay = if first {
            config.interval.mul_f64(fastrand::f64() * 0.25)
        } else {
            config.interval.mul_f64(0.9 + fastrand::f64() * 0.2)
        };
        first = false;
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
        let answer = ask(address, config.timeout).await;
        host.lock()
            .expect("agent state poisoned")
            .record_agent(id, answer);
    }
}

/// Why a backend's agent gave no usable answer.
#[derive(Debug, thiserror::Error)]
pub enum AgentCheckError {
    /// Connecting or reading failed (refused, reset ...).
    #[error("agent {address}: {error}")]
    Io {
        address: SocketAddr,
        error: std::io::Error,
    },
    #[error("agent {address} answered {line:?}: {why}")]
    Malformed {
        address: SocketAddr,
        line: String,
        why: AgentReplyError,
    },
    #[error("agent {address}: no answer within {}", humantime::format_duration(*.timeout))]
    Silent {
        address: SocketAddr,
        timeout: Duration,
    },
}

/// Connects to a backend's agent and reads its answer: up to the first newline, the end
/// of the stream, or `ANSWER_CAP` bytes.
pub async fn ask(address: SocketAddr, timeout: Duration) -> Result<AgentReport, AgentCheckError> {
    let io = |error| AgentCheckError::Io { address, error };
    let read = async {
        let mut stream = TcpStream::connect(address).await.map_err(io)?;
        let mut answer = Vec::with_capacity(64);
        let mut buffer = [0u8; ANSWER_CAP];
        while answer.len() < ANSWER_CAP && !answer.contains(&b'\n') {
            let n = stream
                .read(&mut buffer[..ANSWER_CAP - answer.len()])
                .await
                .map_err(io)?;
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buffer[..n]);
        }
        let text = String::from_utf8_lossy(&answer);
        let line = text.lines().next().unwrap_or("");
        parse_agent_reply(line).map_err(|why| AgentCheckError::Malformed {
            address,
            line: line.into(),
            why,
        })
    };
    tokio::time::timeout(timeout, read)
        .await
        .unwrap_or(Err(AgentCheckError::Silent { address, timeout }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;

    async fn agent_saying(text: &'static str) -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let _ = stream.write_all(text.as_bytes()).await;
            }
        });
        address
    }

    #[tokio::test]
    async fn an_agent_answer_is_read_and_parsed() {
        let second = Duration::from_secs(1);
        let report = ask(agent_saying("75% drain\n").await, second)
            .await
            .unwrap();
        assert_eq!(report.weight_percent, Some(75));
        let no_newline = ask(agent_saying("ready").await, second).await.unwrap();
        assert_eq!(no_newline.admin, Some(crate::config::AdminState::Ready));
        let bad = ask(agent_saying("sideways\n").await, second)
            .await
            .unwrap_err();
        assert!(
            matches!(
                &bad,
                AgentCheckError::Malformed {
                    why: AgentReplyError::UnknownWord { .. },
                    ..
                }
            ),
            "{bad}"
        );
        assert!(
            bad.to_string()
                .contains("answered \"sideways\": unknown word"),
            "{bad}"
        );
    }

    #[tokio::test]
    async fn a_silent_or_absent_agent_is_an_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let silent = listener.local_addr().unwrap();
        let error = ask(silent, Duration::from_millis(100)).await.unwrap_err();
        assert!(matches!(error, AgentCheckError::Silent { .. }), "{error}");
        assert_eq!(
            error.to_string(),
            format!("agent {silent}: no answer within 100ms")
        );
        drop(listener);
        let error = ask(silent, Duration::from_secs(1)).await.unwrap_err();
        assert!(matches!(error, AgentCheckError::Io { .. }), "{error}");
        assert!(error.to_string().contains("refused"), "{error}");
    }
}
