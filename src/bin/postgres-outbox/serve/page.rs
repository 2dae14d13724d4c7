//! The pages' common frame and pieces. Everything shown passes through `esc`.

use std::fmt::Write;

use super::http::{esc, Response};

const STYLE: &str = "body{font:14px system-ui,sans-serif;margin:0;color:#222}\
header{background:#24292f;color:#fff;padding:8px 16px;display:flex;gap:16px;align-items:center}\
header a{color:#fff}main{padding:12px 16px;max-width:1100px}\
table{border-collapse:collapse;margin:6px 0 14px}td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}\
th{background:#f6f8fa}td.n{text-align:right;font-variant-numeric:tabular-nums}\
.card{border:1px solid #ddd;border-radius:6px;padding:8px 12px;margin:10px 0}\
.bad{color:#b00020}.ok{color:#1a7f37}.note{color:#666}.charts{display:flex;flex-wrap:wrap;gap:8px}\
form.inline{display:inline}button{cursor:pointer}pre{background:#f6f8fa;padding:8px;overflow:auto;max-height:30em}";

/// A whole page: the frame, a title and `body` (already escaped HTML).
pub fn page(title: &str, body: &str, session: Option<&str>, can_log_in: bool) -> String {
    let account = match (session, can_log_in) {
        (Some(csrf), _) => format!(
            r#"<form class="inline" method="post" action="/logout"><input type="hidden" name="csrf" value="{}"><button>log out</button></form>"#,
            esc(csrf)
        ),
        (None, true) => r#"<a href="/login">log in</a>"#.to_owned(),
        (None, false) => String::new(),
    };
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width\"><title>{t} - postgres-outbox</title>\
         <style>{STYLE}</style></head><body><header><strong>postgres-outbox</strong>\
         <a href=\"/\">overview</a><span style=\"flex:1\"></span>{account}</header>\
         <main><h1>{t}</h1>{body}</main></body></html>",
        t = esc(title)
    )
}

/// A page with only a message, for an error.
pub fn message(status: u16, title: &str, text: &str) -> Response {
    Response::html(
        status,
        page(
            title,
            &format!("<p class=\"bad\">{}</p>", esc(text)),
            None,
            false,
        ),
    )
}

/// A table of `rows` under `headings`; each cell is escaped HTML already.
pub fn table(headings: &[&str], rows: &[Vec<String>]) -> String {
    let mut html = String::from("<table><tr>");
    for h in headings {
        let _ = write!(html, "<th>{}</th>", esc(h));
    }
    html.push_str("</tr>");
    for row in rows {
        html.push_str("<tr>");
        for cell in row {
            html.push_str(cell);
        }
        html.push_str("</tr>");
    }
    html.push_str("</table>");
    html
}

/// A table cell of text.
pub fn cell(text: &str) -> String {
    format!("<td>{}</td>", esc(text))
}

/// A right-aligned cell of a number, with an id to read it by.
pub fn number(id: &str, n: u64) -> String {
    format!("<td class=\"n\" id=\"{}\">{n}</td>", esc(id))
}
