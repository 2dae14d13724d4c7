//! Who may change rows: a client that shows the token, as `Authorization: Bearer <token>`,
//! or a browser holding a session cookie from the login form. A session's forms carry its
//! CSRF token, which a page of another site cannot read, so it cannot post them for you.
//!
//! Cookies ignore ports: every web app on the same host name receives ours, and can set
//! one of the same name. The name is therefore this server's own (random, made at start),
//! so nothing set before it ran shadows it, and every cookie of that name is tried, so one
//! planted later cannot break a session either. That a neighbour on the same host name
//! receives the cookie no cookie attribute prevents over plain HTTP (`__Host-` and
//! `Secure` need HTTPS); an operator who runs other web apps on localhost opens this one
//! under an address of its own (`--bind 127.0.0.2:8080`), whose cookies go nowhere else.
//!
//! Wrong tokens, by a login or a header, draw on one budget that refills slowly, so
//! guessing runs at about one try a second whatever the attacker sends, and the log gets
//! a line per counted try and one when the budget runs out, not one per request.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rand::RngCore;

use super::http::{Fields, Request, Response};

/// The wrong tokens taken at once, and how often one more is taken: past them, every
/// token is refused unchecked until the budget refills.
const WRONG_BURST: f64 = 10.0;
const WRONG_REFILL: Duration = Duration::from_secs(1);
/// How long a login lasts.
const SESSION_LIFE: Duration = Duration::from_secs(12 * 3600);
/// Logins held at once; past it, expired ones go first, then logins are refused.
const MAX_SESSIONS: usize = 1024;
/// The shortest token taken: guessing 16 random characters is out of reach.
pub const MIN_TOKEN: usize = 16;
/// The fewest distinct characters a token may have: sixteen `a`s are not random.
pub const MIN_DISTINCT: usize = 8;

struct Session {
    csrf: String,
    expires: Instant,
}

/// How a request proved who it is.
pub enum Who {
    Nobody,
    /// The token itself, in a header: no browser sends it on its own, so no CSRF check.
    Bearer,
    /// A login's session, with the CSRF token its forms carry.
    Session {
        csrf: String,
    },
}

impl Who {
    pub fn is_known(&self) -> bool {
        !matches!(self, Who::Nobody)
    }

    /// The CSRF token a page's forms carry for this client.
    pub fn csrf(&self) -> Option<&str> {
        match self {
            Who::Session { csrf } => Some(csrf),
            _ => None,
        }
    }
}

pub struct Auth {
    token: Option<String>,
    sessions: Mutex<HashMap<String, Session>>,
    /// This server's cookie name.
    cookie: String,
    wrong: Mutex<Budget>,
}

/// Wrong tokens still taken (a token bucket), as of `at`; `spent` once said in the log.
struct Budget {
    left: f64,
    at: Instant,
    said: bool,
}

/// Why a token was not taken.
#[derive(Debug, PartialEq)]
pub enum Refusal {
    Wrong,
    /// Too many wrong ones lately: not even compared.
    Throttled,
}

impl Auth {
    pub fn new(token: Option<String>) -> Auth {
        Auth {
            token,
            sessions: Mutex::new(HashMap::new()),
            cookie: format!("outbox_{}", &random_hex()[..16]),
            wrong: Mutex::new(Budget {
                left: WRONG_BURST,
                at: Instant::now(),
                said: false,
            }),
        }
    }

    /// Whether `offered` is the token; a wrong one spends the budget, and while it is
    /// spent nothing is compared.
    fn check(&self, offered: &str) -> Result<(), Refusal> {
        let Some(token) = &self.token else {
            return Err(Refusal::Wrong);
        };
        let Ok(mut budget) = self.wrong.lock() else {
            return Err(Refusal::Throttled);
        };
        let now = Instant::now();
        let refilled = now.duration_since(budget.at).as_secs_f64() / WRONG_REFILL.as_secs_f64();
        budget.left = (budget.left + refilled).min(WRONG_BURST);
        budget.at = now;
        if budget.left < 1.0 {
            if !budget.said {
                budget.said = true;
                log::warn!(
                    "serve: too many wrong tokens; every token is refused unchecked for a \
                     while (one more is tried each second)"
                );
            }
            return Err(Refusal::Throttled);
        }
        if same(offered.trim().as_bytes(), token.as_bytes()) {
            return Ok(());
        }
        budget.left -= 1.0;
        budget.said = false;
        log::warn!("serve: a wrong token was refused");
        Err(Refusal::Wrong)
    }

    pub fn has_token(&self) -> bool {
        self.token.is_some()
    }

    pub fn who(&self, request: &Request) -> Who {
        if self.token.is_none() {
            return Who::Nobody;
        }
        if let Some(offered) = request
            .header("authorization")
            .and_then(|v| v.strip_prefix("Bearer "))
        {
            if self.check(offered).is_ok() {
                return Who::Bearer;
            }
        }
        let Ok(sessions) = self.sessions.lock() else {
            return Who::Nobody;
        };
        let now = Instant::now();
        request
            .cookies(&self.cookie)
            .find_map(|id| sessions.get(id).filter(|s| s.expires > now))
            .map_or(Who::Nobody, |s| Who::Session {
                csrf: s.csrf.clone(),
            })
    }

    /// A new session for a client that offered the right token: its cookie's value.
    pub fn login(&self, offered: &str) -> Result<String, (u16, &'static str)> {
        if self.token.is_none() {
            return Err((401, "this server has no token: it takes no changes"));
        }
        match self.check(offered) {
            Ok(()) => {}
            Err(Refusal::Wrong) => return Err((401, "wrong token")),
            Err(Refusal::Throttled) => {
                return Err((429, "too many wrong tokens lately: try again in a minute"))
            }
        }
        let mut sessions = self
            .sessions
            .lock()
            .map_err(|_| (503, "sessions unavailable"))?;
        let now = Instant::now();
        sessions.retain(|_, s| s.expires > now);
        if sessions.len() >= MAX_SESSIONS {
            return Err((503, "too many sessions: try again later"));
        }
        let id = random_hex();
        sessions.insert(
            id.clone(),
            Session {
                csrf: random_hex(),
                expires: now + SESSION_LIFE,
            },
        );
        Ok(id)
    }

    pub fn logout(&self, request: &Request) {
        if let Ok(mut sessions) = self.sessions.lock() {
            for id in request.cookies(&self.cookie) {
                sessions.remove(id);
            }
        }
    }

    /// A change may go ahead: the client is known and, if by a session, the form carries
    /// that session's CSRF token.
    pub fn allow_change(&self, request: &Request, form: &Fields) -> Result<(), Response> {
        match self.who(request) {
            Who::Nobody => Err(Response::text(
                401,
                "a change needs the token: log in, or send Authorization: Bearer <token>",
            )),
            Who::Bearer => Ok(()),
            Who::Session { csrf } => match form.get("csrf") {
                Some(sent) if same(sent.as_bytes(), csrf.as_bytes()) => Ok(()),
                _ => Err(Response::text(
                    403,
                    "the form's CSRF token is missing or stale: reload the page",
                )),
            },
        }
    }

    /// The cookie that holds session `id`: not for scripts, and never sent along by
    /// another site's request.
    pub fn cookie(&self, id: &str) -> String {
        format!(
            "{}={id}; HttpOnly; SameSite=Strict; Path=/; Max-Age={}",
            self.cookie,
            SESSION_LIFE.as_secs()
        )
    }

    /// The cookie that ends this server's session in the browser.
    pub fn expired_cookie(&self) -> String {
        format!(
            "{}=; HttpOnly; SameSite=Strict; Path=/; Max-Age=0",
            self.cookie
        )
    }
}

/// 32 random bytes in hex, from the thread's CSPRNG.
fn random_hex() -> String {
    let mut bytes = [0u8; 32];
    rand::thread_rng().fill_bytes(&mut bytes);
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Compares in time that does not depend on where the two differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_token_logs_in_and_sessions_differ() {
        let auth = Auth::new(Some("0123456789abcdef".into()));
        assert!(auth.login("0123456789abcdeX").is_err());
        assert!(auth.login("").is_err());
        let (a, b) = (
            auth.login("0123456789abcdef").unwrap(),
            auth.login("0123456789abcdef").unwrap(),
        );
        assert_ne!(a, b);
        assert_eq!(a.len(), 64);
        assert!(Auth::new(None).login("anything").is_err());
    }

    #[test]
    fn wrong_tokens_past_the_burst_are_refused_unchecked_even_the_right_one() {
        let auth = Auth::new(Some("0123456789abcdef".into()));
        let mut wrong = 0;
        while auth.check("not-the-token-xx") == Err(Refusal::Wrong) {
            wrong += 1;
        }
        assert!(
            wrong <= WRONG_BURST as usize + 1,
            "{wrong} wrong tries taken"
        );
        assert_eq!(auth.check("0123456789abcdef"), Err(Refusal::Throttled));
    }

    #[test]
    fn each_server_has_a_cookie_name_of_its_own() {
        assert_ne!(Auth::new(None).cookie, Auth::new(None).cookie);
    }
}
