//! [`role_ref!`]: a role's typed reference, declared once.

/// Declares a role's reference: a struct of one recipient per message (`field: Message`)
/// that derives `Debug` and `Clone`, and its three constructors and services:
///
/// - `local(addr)`: the recipients of an actor of this process (`Handler` and
///   `ToEnvelope` bounds for every message);
/// - `remote(addr)`: the recipients that forward through a
///   [`RemoteAddr`](crate::remote::RemoteAddr) (each message needs its wire name,
///   [`wire_names!`](crate::remote::wire_names));
/// - `serve(&self, node, target)`: serves every message on `node` under `target`.
///
/// A field `name: Link::of(MessageA, MessageB)` holds another reference (`Link`, declared
/// with this macro, whose local constructor is `of`) rather than a recipient; its messages
/// join the bounds of `local`.
///
/// ```text
/// role_ref! {
///     /// One rollout worker, in this process or another.
///     pub struct RolloutRef {
///         /// Starts its fragment loop.
///         start: StartRollouts,
///         /// Stops it after its current fragment.
///         stop: StopRollouts,
///     }
///     /// The reference of a worker of this process.
///     pub fn local(worker);
///     /// The reference of a worker another process serves.
///     pub fn remote(worker);
///     /// Serves the worker's protocol on `node` under `target`.
///     pub fn serve;
/// }
/// ```
macro_rules! role_ref {
    // One field's value in `local`, `remote` and `serve`.
    (@local $addr:ident; recipient) => {
        $addr.clone().recipient()
    };
    (@local $addr:ident; link $link:ident $of:ident) => {
        $link::$of($addr)
    };
    (@remote $addr:ident; recipient) => {
        $addr.recipient()
    };
    (@remote $addr:ident; link $link:ident $of:ident) => {
        $link::remote($addr)
    };
    (@serve $field:expr, $node:ident, $target:ident; recipient) => {
        $crate::remote::serve($node, $target, $field.clone())
    };
    (@serve $field:expr, $node:ident, $target:ident; link $link:ident $of:ident) => {
        $field.serve($node, $target)
    };

    // The fields, one at a time, into `{ [attributes] name (type) (kind) [messages] }`.
    (@fields { $($head:tt)* } { $($methods:tt)* } [ $($fields:tt)* ]) => {
        $crate::protocol::role_ref!(@emit $($head)*; [ $($fields)* ] $($methods)*);
    };
    (@fields { $($head:tt)* } { $($methods:tt)* } [ $($fields:tt)* ]
        $(#[$attr:meta])* $field:ident : $link:ident :: $of:ident ( $($message:ty),* $(,)? )
        $(, $($rest:tt)*)?
    ) => {
        $crate::protocol::role_ref!(@fields { $($head)* } { $($methods)* } [
            $($fields)*
            { [$(#[$attr])*] $field ($link) (link $link $of) [$($message),*] }
        ] $($($rest)*)?);
    };
    (@fields { $($head:tt)* } { $($methods:tt)* } [ $($fields:tt)* ]
        $(#[$attr:meta])* $field:ident : $message:ty
        $(, $($rest:tt)*)?
    ) => {
        $crate::protocol::role_ref!(@fields { $($head)* } { $($methods)* } [
            $($fields)*
            { [$(#[$attr])*] $field (::actix::Recipient<$message>) (recipient) [$message] }
        ] $($($rest)*)?);
    };

    (@emit
        $(#[$meta:meta])* $vis:vis struct $name:ident;
        [ $( { [$(#[$attr:meta])*] $field:ident ($ty:ty) ($($kind:tt)*) [$($message:ty),*] } )* ]
        $(#[$local_doc:meta])* $local_vis:vis fn $local:ident($local_addr:ident);
        $(#[$remote_doc:meta])* $remote_vis:vis fn remote($remote_addr:ident);
        $(#[$serve_doc:meta])* $serve_vis:vis fn serve;
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone)]
        $vis struct $name {
            $(
                $(#[$attr])*
                pub $field: $ty,
            )*
        }

        impl $name {
            $(#[$local_doc])*
            $local_vis fn $local<A>($local_addr: &::actix::Addr<A>) -> Self
            where
                A: ::actix::Actor $($( + ::actix::Handler<$message> )*)*,
                A::Context: $($( ::actix::dev::ToEnvelope<A, $message> + )*)*,
            {
                Self {
                    $( $field: $crate::protocol::role_ref!(@local $local_addr; $($kind)*), )*
                }
            }

            $(#[$remote_doc])*
            $remote_vis fn remote($remote_addr: &$crate::remote::RemoteAddr) -> Self {
                Self {
                    $( $field: $crate::protocol::role_ref!(@remote $remote_addr; $($kind)*), )*
                }
            }

            $(#[$serve_doc])*
            $serve_vis fn serve(&self, node: &::refit_node::Node, target: ::uuid::Uuid) {
                $( $crate::protocol::role_ref!(@serve self.$field, node, target; $($kind)*); )*
            }
        }
    };

    (
        $(#[$meta:meta])* $vis:vis struct $name:ident { $($fields:tt)* }
        $($methods:tt)*
    ) => {
        $crate::protocol::role_ref!(@fields { $(#[$meta])* $vis struct $name } { $($methods)* } []
            $($fields)*);
    };
}
pub(crate) use role_ref;
